"""Register groups and the per-task view (sim/regfile.py): which value a register a task
did not write would carry on a board, and that the view refuses to read it."""

from __future__ import annotations

import pytest

from ggml_rknpu.hw.registers import REGISTERS, Block
from ggml_rknpu.sim.regfile import RegisterFile
from ggml_rknpu.sim.validate import TaskRefused

DST = REGISTERS["DPU_DST_BASE_ADDR"].offset
DPU_S_POINTER = REGISTERS["DPU_S_POINTER"].offset
PP = REGISTERS["DPU_S_POINTER"].encode(POINTER_PP_EN=1, EXECUTER_PP_EN=1, POINTER_PP_MODE=1)


def run_tasks(rf: RegisterFile, values: list[int | None]) -> None:
    for t, v in enumerate(values):
        rf.begin_task(t)
        if v is not None:
            rf.write(DST, v)
        rf.end_task({Block.DPU})


def stale_message(rf: RegisterFile, t: int) -> str:
    rf.begin_task(t)
    with pytest.raises(TaskRefused) as exc:
        rf.view(t).value("DPU_DST_BASE_ADDR")
    assert exc.value.violation.rule == "unwritten-register"
    return str(exc.value)


def test_written_register_reads_back():
    rf = RegisterFile()
    rf.begin_task(0)
    rf.write(DST, 0x3000_0000)
    assert rf.view(0).value("DPU_DST_BASE_ADDR") == 0x3000_0000


def test_pingpong_inherits_from_two_tasks_back():
    rf = RegisterFile()
    rf.begin_task(0)
    rf.write(DPU_S_POINTER, PP)
    rf.write(DST, 0xA0)
    rf.end_task({Block.DPU})
    rf.begin_task(1)                             # task 1 writes group 1
    rf.write(DST, 0xB0)
    rf.end_task({Block.DPU})
    msg = stale_message(rf, 2)                   # task 2 is back on group 0
    assert "group 0 still holds 0x000000A0 from task 0" in msg


def test_without_pingpong_inherits_from_the_previous_task():
    rf = RegisterFile()
    run_tasks(rf, [0xA0, 0xB0])
    assert "group 0 still holds 0x000000B0 from task 1" in stale_message(rf, 2)


def test_pointer_clear_returns_to_group_zero():
    rf = RegisterFile()
    rf.begin_task(0)
    rf.write(DPU_S_POINTER, PP)
    rf.write(DST, 0xA0)
    rf.end_task({Block.DPU})                     # now on group 1
    assert rf.pointers[Block.DPU].group == 1
    rf.write(DPU_S_POINTER, REGISTERS["DPU_S_POINTER"].encode(POINTER_PP_CLEAR=1))
    assert rf.pointers[Block.DPU].group == 0


def test_never_written_register_is_named():
    rf = RegisterFile()
    assert "never written since reset" in stale_message(rf, 0)
