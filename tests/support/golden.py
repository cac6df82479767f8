"""The hardware-validated MTX golden streams (tests/data/oracle/golden) and how tests compare
register streams with them: the compiler's golden test and the ladder's golden rung."""

from __future__ import annotations

import json

from ggml_rknpu.hw.regcmd import decode_word

A, B, C, REGCMD = 0x10000000, 0x20000000, 0x30000000, 0x40000000
MODES = {"fp16_fp32": ("fp16", "fp32"), "int8_int32": ("int8", "int32"), "fp16_fp16": ("fp16", "fp16")}


def register_map(words) -> dict[tuple[int, int], int]:
    out = {}
    for w in words:
        if int(w) == 0:
            continue
        target, value, offset = decode_word(int(w))
        out[(target, offset)] = value
    return out


def golden_cases(reference_dir):
    return json.loads((reference_dir / "golden/mtx512-single-task.json").read_text())["cases"]
