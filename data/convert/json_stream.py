"""Reading a JSON array (or JSON lines, or concatenated JSON values) one element at a time: memory holds one element
and one chunk of text, not the file, so a LLaVA file of millions of records converts on a small machine."""

from __future__ import annotations

import codecs
import json
from pathlib import Path

__all__ = ["JSONSyntaxError", "records"]

CHUNK = 1 << 20  # characters read at a time
MAX_RECORD = 64 << 20  # one element larger than this is an error (not a reason to read the whole file)


class JSONSyntaxError(ValueError):
    """The file is not valid JSON at a character offset."""


class _Reader:
    def __init__(self, handle, chunk: int):
        self.handle, self.chunk = handle, chunk
        self.buf, self.pos, self.consumed, self.eof = "", 0, 0, False  # consumed: characters dropped from the front
        self.lines, self.line_start = 0, 0  # newlines dropped with them; where the line after the last one starts

    def fill(self) -> None:
        try:
            more = self.handle.read(self.chunk)
        except UnicodeDecodeError as err:
            line, byte = _first_bad_byte(self.handle.name)
            raise JSONSyntaxError(f"not UTF-8 text at line {line} (byte {byte}: {err.reason}); JSON is UTF-8: "
                                  f"re-encode the file, e.g. with iconv -t utf-8") from None
        self.eof = not more
        dropped = self.buf[:self.pos]
        if "\n" in dropped:
            self.lines += dropped.count("\n")
            self.line_start = self.consumed + dropped.rindex("\n") + 1
        self.buf, self.consumed, self.pos = self.buf[self.pos:] + more, self.consumed + self.pos, 0

    def where(self, pos: int) -> str:
        """Line, column and character of `pos` in the buffer, as an editor counts them (from 1)."""
        before = self.buf[:pos]
        line = self.lines + before.count("\n") + 1
        start = self.consumed + before.rindex("\n") + 1 if "\n" in before else self.line_start
        return f"line {line}, column {self.consumed + pos - start + 1} (character {self.consumed + pos})"

    def skip_space(self) -> None:
        while True:
            while self.pos < len(self.buf) and self.buf[self.pos] in " \t\r\n":
                self.pos += 1
            if self.pos < len(self.buf) or self.eof:
                return
            self.fill()

    def at(self) -> str:
        return self.buf[self.pos] if self.pos < len(self.buf) else ""


def _first_bad_byte(path) -> tuple[int, int]:
    """(line, byte offset) of the first byte that is not UTF-8, read again in binary (an error's path only)."""
    decoder, offset, lines = codecs.getincrementaldecoder("utf-8")(), 0, 1
    with open(path, "rb") as handle:
        while block := handle.read(CHUNK):
            try:
                decoder.decode(block)
            except UnicodeDecodeError as err:
                start = max(err.start - len(err.object) + len(block), 0)  # the decoder prepends a partial character
                return lines + block[:start].count(b"\n"), offset + start
            offset, lines = offset + len(block), lines + block.count(b"\n")
    return lines, offset


def records(path: Path, chunk: int = CHUNK):
    """Yield (index, character offset, value) for each element of a top-level JSON array, or each value of a JSON
    lines / concatenated JSON file. Raises JSONSyntaxError naming the character where the JSON breaks."""
    decoder = json.JSONDecoder()
    with open(path, encoding="utf-8") as handle:
        r = _Reader(handle, chunk)
        r.fill()
        r.skip_space()
        in_array = r.at() == "["
        if in_array:
            r.pos += 1
        index = 0
        while True:
            r.skip_space()
            if not r.at():
                if in_array:
                    raise JSONSyntaxError(f"the array is not closed (the file ends at {r.where(r.pos)})")
                return
            if in_array and r.at() == "]":
                return
            while True:
                try:
                    value, end = decoder.raw_decode(r.buf, r.pos)
                    break
                except json.JSONDecodeError as err:
                    if r.eof or len(r.buf) - r.pos > MAX_RECORD:  # json's message, whole: "... starting at" a place
                        at = f"{err.msg} {r.where(err.pos)}" if err.msg.endswith(" at") else \
                            f"{err.msg} at {r.where(err.pos)}"
                        raise JSONSyntaxError(f"not valid JSON: {at}") from None
                    r.fill()  # the element may go on past the buffer: read more and try again
            yield index, r.consumed + r.pos, value
            index, r.pos = index + 1, end
            r.skip_space()
            if in_array and r.at():
                if r.at() == ",":
                    r.pos += 1
                elif r.at() != "]":
                    raise JSONSyntaxError(f"not valid JSON: expected ',' or ']' at {r.where(r.pos)}")
