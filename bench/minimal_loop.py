"""The least a training loop written directly on megatron-core does for a MIMO model on one set of ranks: the
reference `loop_overhead.py` holds mimo's loop against.

It builds megatron-core's MimoModel from the same module specs, wraps each module in megatron-core's DDP, and
steps with megatron-core's schedule (`forward_backward_no_pipelining`), MimoOptimizer and OptimizerParamScheduler.
The loss is the per-token one mimo uses (the sum over tokens divided by the global token count). Nothing else:
no metrics, no non-finite checks, no timers, no checkpoints.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


class MinimalLoop:
    def __init__(self, language_spec, encoder_specs: dict, placeholder_ids: dict, grids: dict, pg_collections: dict,
                 device: torch.device, params_dtype: torch.dtype, optimizer_config, lr: float,
                 num_microbatches: int, micro_batch_size: int, global_batch_size: int, data, weights_from=None):
        from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
        from megatron.core.enums import ModelType
        from megatron.core.models.mimo import MimoModel, MimoModelConfig
        from megatron.core.models.mimo.optimizer import get_mimo_optimizer
        from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

        config = MimoModelConfig(language_model_spec=language_spec, modality_submodules_spec=encoder_specs,
                                 special_token_ids=placeholder_ids, module_to_grid_map=grids)
        model = MimoModel(config).to(device)
        model.model_type = ModelType.encoder_or_decoder
        ddp_config = DistributedDataParallelConfig(grad_reduce_in_fp32=True)
        self.modules = {}
        for name, module in [*model.modality_submodules.items(), ("language", model.language_model)]:
            if weights_from is not None:  # the same starting point as the loop it is compared with
                source = weights_from.language_model if name == "language" else weights_from.modality_submodules[name]
                module.load_state_dict(source.state_dict())
            module = module.to(params_dtype)
            wrapped = DistributedDataParallel(_config_of(module), ddp_config, module,
                                              pg_collection=pg_collections[name])
            if name == "language":
                model.language_model = wrapped
            else:
                model.modality_submodules[name] = wrapped
            self.modules[name] = wrapped
        self.model, self.device, self.params_dtype = model, device, params_dtype
        self.optimizer = get_mimo_optimizer(model, optimizer_config)
        self.scheduler = OptimizerParamScheduler(
            self.optimizer, init_lr=lr, max_lr=lr, min_lr=lr, lr_warmup_steps=0, lr_decay_steps=1,
            lr_decay_style="constant", start_wd=optimizer_config.weight_decay,
            end_wd=optimizer_config.weight_decay, wd_incr_steps=1, wd_incr_style="constant")
        self.pg_collections, self.data = pg_collections, data
        self.num_microbatches, self.micro_batch_size = num_microbatches, micro_batch_size
        self.global_batch_size = global_batch_size
        model.language_model.config.finalize_model_grads_func = self._finalize_grads
        self.losses: list[torch.Tensor] = []  # [loss sum, tokens] per iteration, read after timing

    def _forward_step(self, data_iterator, model):
        batch = next(data_iterator)
        inputs = {k: v.to(self.device, non_blocking=True) for k, v in batch.items() if k != "modality_inputs"}
        modality = {name: {enc: {k: v.to(self.device, self.params_dtype if v.is_floating_point() else v.dtype,
                                         non_blocking=True) for k, v in tensors.items()}
                           for enc, tensors in encoders.items()}
                    for name, encoders in batch["modality_inputs"].items()}
        output, loss_mask = model(**inputs, modality_inputs=modality or None)

        def loss_func(output_tensor):
            mask = loss_mask.float()
            loss_sum = (output_tensor.float() * mask).sum()
            tokens = mask.sum().int()
            return loss_sum, tokens, {"lm loss": torch.stack([loss_sum.detach(), tokens.float()])}

        return output, loss_func

    def _finalize_grads(self, model_chunks, num_tokens, pg_collection=None, force_all_reduce=False):
        from megatron.core.distributed.finalize_model_grads import finalize_model_grads

        dist.all_reduce(num_tokens)
        for name, module in self.modules.items():
            finalize_model_grads([module], num_tokens=None, pg_collection=self.pg_collections[name])
            module.scale_gradients(1.0 / num_tokens.item())

    def step(self) -> None:
        from megatron.core.pipeline_parallel.schedules import forward_backward_no_pipelining

        self.model.zero_grad_buffer()
        self.optimizer.zero_grad()
        reported = forward_backward_no_pipelining(
            forward_step_func=self._forward_step, data_iterator=self.data, model=[self.model],
            num_microbatches=self.num_microbatches, seq_length=0, micro_batch_size=self.micro_batch_size,
            forward_only=False, pg_collection=self.pg_collections["language"])
        ok, _, _ = self.optimizer.step()
        if ok:
            self.scheduler.step(increment=self.global_batch_size)
        self.losses.append(sum(r["lm loss"] for r in reported))


def _config_of(module):
    from megatron.core.transformer.module import MegatronModule

    return next(m.config for m in module.modules() if isinstance(m, MegatronModule))
