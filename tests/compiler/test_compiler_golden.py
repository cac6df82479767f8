"""Golden: our single-task streams equal the hardware-validated MTX streams.

No deliberate deviations arise for these 15 shapes: the compiler reproduces every body
word (and the tail) bit for bit, so the exception list below is empty. If a future
change deviates on purpose, list the register there with the reason."""

from __future__ import annotations

import pytest

from ggml_rknpu.compiler.matmul import compile_matmul
from support.golden import MODES, REGCMD, A, B, C, golden_cases, register_map

DELIBERATE_EXCEPTIONS: dict[int, str] = {}   # register offset -> reason (none needed)


def test_all_golden_shapes_match(reference_dir):
    cases = golden_cases(reference_dir)
    assert len(cases) == 15
    for case in cases:
        dtype, out = MODES[case["mode"]]
        assert (int(case["feature_dma"], 16), int(case["weights_dma"], 16), int(case["output_dma"], 16)) == (A, B, C)
        prog = compile_matmul(case["M"], case["K"], case["N"], dtype=dtype, out=out)
        assert len(prog.tasks) == 1, case
        task = prog.tasks[0]
        words = prog.bind(a=A, b=B, c=C, regcmd=REGCMD)
        ours = words[task.word_offset: task.word_offset + task.body_words + 4]
        golden = [int(w, 16) for w in case["words"]]
        ours_map = {k: v for k, v in register_map(ours).items() if k[1] not in DELIBERATE_EXCEPTIONS}
        gold_map = {k: v for k, v in register_map(golden).items() if k[1] not in DELIBERATE_EXCEPTIONS}
        assert ours_map == gold_map, (case["mode"], case["M"], case["K"], case["N"])
        # stronger: same words in the same order, body count = MTX regcfg_amount 104
        assert [int(w) for w in ours] == golden
        assert task.body_words == 104


# fp16 M=4 K=64 N=32 -> fp32 at 0x10000000/0x20000000/0x30000000 [npu-programming.md §7 table]
SECTION7_EXAMPLE = {
    0x4004: 0xE, 0x100C: 0x120, 0x1010: 0x50, 0x1014: 0x9, 0x1020: 0x00010004,
    0x1024: 0x003F0040, 0x1028: 1, 0x102C: 4, 0x1030: 0x1000, 0x1034: 0x80,
    0x1038: 0x01010020, 0x1040: 0xB1, 0x1044: 2, 0x104C: 0xB,
    0x1050: 0x00010000, 0x1054: 0x00010000, 0x1058: 0x00010000, 0x105C: 0x00010000,
    0x1060: 0, 0x1064: 0, 0x1074: 0, 0x1068: 0, 0x1070: 0x10000000, 0x1078: 0x000F000F,
    0x107C: 4, 0x1080: 0, 0x1084: 0x00010004, 0x1088: 0x40, 0x1100: 0, 0x1104: 0,
    0x1110: 0x20000000, **{0x1140 + 4 * i: 0 for i in range(16)}, 0x1180: 0, 0x1184: 0,
    0x3010: 0x201, 0x3014: 0x00030000, 0x3018: 0x1F, 0x301C: 0, 0x3030: 0,
    0x400C: 0x1E4, 0x4010: 0xA8000002, 0x4014: 0, 0x4020: 0x30000000, 0x4024: 0x40,
    0x4030: 0, 0x4034: 3, 0x4038: 0, 0x403C: 0x001F001F, 0x4040: 0x53, 0x4044: 0,
    0x4048: 0, 0x404C: 0, 0x4050: 0x36E, 0x4054: 0, 0x4058: 0x1F, 0x405C: 0x00030000,
    0x4060: 0x53, 0x4064: 0, 0x4068: 0, 0x406C: 0, 0x4070: 0x383, 0x4074: 0, 0x4078: 1,
    0x407C: 0, 0x4080: 0, 0x4084: 0x1, 0x4088: 0, **{0x4090 + 4 * i: 0 for i in range(8)},
    0x40C0: 0x100, 0x40C4: 0, **{0x4100 + 4 * i: 0 for i in range(12)},
}


def test_section7_example_fp16_4x64x32():
    prog = compile_matmul(4, 64, 32, dtype="fp16", out="fp32")
    assert len(prog.tasks) == 1
    words = prog.bind(a=A, b=B, c=C, regcmd=REGCMD)
    body = words[: prog.tasks[0].body_words]
    ours = {offset: value for (_t, offset), value in register_map(body).items()}
    assert ours == SECTION7_EXAMPLE
    # tail: last task, enable CNA|CORE|DPU = 0x0D [§7 "Tail ... enable 0x0D"]
    tail = [int(w) for w in words[104:108]]
    assert tail == [0, 0x0101000000000014, 0x0041000000000000, 0x00810000000D0008]


@pytest.mark.parametrize("out,expected", [("fp32", 0xA8000002), ("fp16", 0x48000002)])
def test_section7_data_format_variants(out, expected):
    prog = compile_matmul(4, 64, 32, dtype="fp16", out=out)
    regs = {o: v for (_t, o), v in register_map(prog.words[:104]).items()}
    assert regs[0x4010] == expected
    assert regs[0x4050] == {"fp32": 0x36E, "fp16": 0x126}[out]
    assert regs[0x40C0] == {"fp32": 0x100, "fp16": 0x80}[out]   # SURFACE_ADD [§7]
