"""Human-readable regcmd words, for diagnostics and debugging on a board: one line per
word naming the target, register and non-zero fields (decoded with the database)."""

from __future__ import annotations

from collections.abc import Iterable

from ggml_rknpu.hw.regcmd import OP_ENABLE_OFFSET, OpEnable, Target, decode_word
from ggml_rknpu.hw.registers import BY_OFFSET


def describe_word(word: int) -> str:
    if word == 0:
        return "NOP"
    target, value, offset = decode_word(word)
    if target == Target.MARKER:
        return "MARKER (0x0041: pre-op-enable)"
    if target == Target.OP_ENABLE and offset == OP_ENABLE_OFFSET:
        return f"OP_ENABLE {OpEnable(value)!r} (0x{value:X})"
    try:
        tname = Target(target).name
    except ValueError:
        tname = f"target 0x{target:04X}"
    reg = BY_OFFSET.get(offset)
    if reg is None:
        return f"{tname} ??? 0x{offset:04X} = 0x{value:08X} (unknown register)"
    fields = " ".join(f"{k}={v}" for k, v in reg.decode(value).items() if v)
    return f"{tname} {reg.name} = 0x{value:08X}" + (f" ({fields})" if fields else "")


def describe_words(words: Iterable[int]) -> list[str]:
    return [describe_word(int(w)) for w in words]
