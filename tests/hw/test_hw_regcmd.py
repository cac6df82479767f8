"""Regcmd word codec, task tail, fetch amounts; golden words decode to known registers."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ggml_rknpu.hw.regcmd import (
    BLOCK_OF_TARGET,
    MATMUL_ENABLE,
    OpEnable,
    Target,
    decode_word,
    fetch_amount,
    regcmd_word,
    target_for_offset,
    task_tail,
    words_for_amount,
    write_word,
)
from ggml_rknpu.hw.registers import BY_OFFSET, Block


@settings(deadline=None)
@given(st.integers(0, 0xFFFF), st.integers(0, 0xFFFF), st.integers(0, 0xFFFFFFFF))
def test_word_round_trip(target, offset, value):
    word = regcmd_word(target, offset, value)
    assert 0 <= word < 1 << 64
    assert decode_word(word) == (target, value, offset)


def test_word_layout_example():
    # DPU_S_POINTER = 0xE is 0x1001_0000_000E_4004 in every MTX stream [§2, golden]
    assert regcmd_word(Target.DPU, 0x4004, 0xE) == 0x10010000000E4004
    assert write_word("DPU_S_POINTER", 0xE) == 0x10010000000E4004


def test_word_rejects_out_of_range():
    with pytest.raises(ValueError):
        regcmd_word(0x10000, 0, 0)
    with pytest.raises(ValueError):
        regcmd_word(Target.CNA, 0x10000, 0)
    with pytest.raises(ValueError):
        regcmd_word(Target.CNA, 0x100C, 1 << 32)


def test_target_for_offset():
    assert target_for_offset(0x100C) is Target.CNA
    assert target_for_offset(0x3010) is Target.CORE
    assert target_for_offset(0x4010) is Target.DPU
    assert target_for_offset(0x501C) is Target.DPU_RDMA
    assert target_for_offset(0x0010) is Target.PC
    with pytest.raises(ValueError):
        target_for_offset(0xF008)


def test_fetch_amounts_match_blob_chain():
    # RKNN 394^3 GEMM chain: next bodies 108/13/12/17 -> amounts 55/8/7/10 [pcchain-notes.md]
    assert [fetch_amount(b) for b in (108, 13, 12, 17)] == [55, 8, 7, 10]
    for body in range(0, 300):
        assert words_for_amount(fetch_amount(body)) in (body + 4, body + 5)


def test_tail_last_task_equals_golden():
    # The last four words of every MTX golden stream [golden/mtx512-single-task.json]
    assert task_tail(0, 0, MATMUL_ENABLE) == [
        0, 0x0101000000000014, 0x0041000000000000, 0x00810000000D0008]


def test_tail_chained():
    words = task_tail(0xFFC33380, 104, OpEnable.CNA | OpEnable.CORE | OpEnable.DPU)
    assert decode_word(words[0]) == (Target.PC, 0xFFC33380, 0x0010)
    assert decode_word(words[1]) == (Target.PC, 53, 0x0014)   # ceil(108/2) - 1
    with pytest.raises(ValueError):
        task_tail(0x1008, 10, MATMUL_ENABLE)   # not 16-byte aligned
    with pytest.raises(ValueError):
        task_tail(0, 10, MATMUL_ENABLE)


def test_golden_words_decode_to_known_registers(reference_dir):
    cases = json.loads((reference_dir / "golden/mtx512-single-task.json").read_text())["cases"]
    assert len(cases) == 15
    for case in cases:
        words = [int(w, 16) for w in case["words"]]
        body = words[:-4]
        for word in body:
            if word == 0:
                continue
            target, value, offset = decode_word(word)
            reg = BY_OFFSET[offset]                       # KeyError = unknown register
            assert BLOCK_OF_TARGET[Target(target)] is reg.block, hex(word)
            assert reg.block is not Block.PC
            reg.decode(value)
        assert words[-4:] == task_tail(0, 0, MATMUL_ENABLE)


def test_vendor_capture_words_decode_to_known_registers(reference_dir):
    """Every word of the raw librknnrt submits (conv + PPU tasks) is a NOP, the marker,
    an op-enable, or a write to a known register of the target's block [captures/raw]."""
    import re

    logs = sorted((reference_dir / "captures/raw").glob("*live_regcmd*.log"))
    assert logs
    pattern = re.compile(r"regcmd_qword\[\d+\] off=0x[0-9a-f]+ value=0x([0-9a-f]+)")
    for log in logs:
        words = [int(w, 16) for w in pattern.findall(log.read_text())]
        assert len(words) > 100, log.name
        for word in words:
            if word == 0:
                continue
            target, value, offset = decode_word(word)
            if target in (Target.MARKER, Target.OP_ENABLE):
                continue
            reg = BY_OFFSET[offset]
            assert BLOCK_OF_TARGET[Target(target)] is reg.block, (log.name, hex(word))


def test_describe_words():
    from ggml_rknpu.hw.describe import describe_word, describe_words

    assert describe_word(0x020100000120100C) == "CNA CNA_CONV_CON1 = 0x00000120 (IN_PRECISION=2 PROC_PRECISION=2)"
    assert describe_word(0) == "NOP"
    assert describe_word(0x0041000000000000).startswith("MARKER")
    assert "CNA|CORE|DPU" in describe_word(0x00810000000D0008)
    assert "unknown register" in describe_word(regcmd_word(Target.CNA, 0x1FF0, 1))
    assert len(describe_words(task_tail(0x40, 10, MATMUL_ENABLE))) == 4
