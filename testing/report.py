"""What a contract check says: a ContractError naming the hook and the rule it broke, or a report of the numbers."""

from __future__ import annotations

from dataclasses import dataclass, field


class ContractError(AssertionError):
    """A provider broke the contract. The message starts with the hook (or part) at fault:

        build_encoders: returned modules ['img'] but model_shape declared ['images']

    An AssertionError, so pytest shows it as a plain test failure with this one line.
    """

    def __init__(self, hook: str, message: str):
        super().__init__(f"{hook}: {message}")
        self.hook = hook
        self.rule = message


@dataclass
class ModuleReport:
    """One module's layout numbers: declared by model_shape, and counted on the built model when it was built."""

    num_layers: int
    hidden_size: int
    num_attention_heads: int
    declared_parameters: int | None = None
    built_parameters: int | None = None


@dataclass
class ContractReport:
    """What the checks found for one provider: its numbers and which hooks the checks called."""

    provider: str
    modules: dict[str, ModuleReport] = field(default_factory=dict)
    seq_length: int | None = None
    losses: list[float] = field(default_factory=list)  # lm loss of each training iteration the check ran
    flops: object | None = None  # what a `model_flops` hook returned, when mimo has that hook
    notes: list[str] = field(default_factory=list)  # checks that did not run, and why
    hooks_called: set[str] = field(default_factory=set)

    def summary(self) -> str:
        """One line per module and a line of notes, for a test log."""
        lines = [f"provider {self.provider}" + (f", seq_length {self.seq_length}" if self.seq_length else "")]
        for name, m in self.modules.items():
            params = f"{m.declared_parameters:,}" if m.declared_parameters is not None else "not reported"
            built = f", built {m.built_parameters:,}" if m.built_parameters is not None else ""
            lines.append(f"  {name}: {m.num_layers} layers, hidden {m.hidden_size}, {m.num_attention_heads} heads, "
                         f"params {params}{built}")
        if self.losses:
            lines.append("  losses: " + ", ".join(f"{x:.4f}" for x in self.losses))
        if self.flops is not None:
            lines.append(f"  model_flops: {self.flops}")
        lines += [f"  note: {n}" for n in self.notes]
        return "\n".join(lines)
