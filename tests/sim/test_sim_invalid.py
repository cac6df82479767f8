"""Invalid programs fail in the simulator the way a board would, one test per rule: no
completion interrupt (the kernel times out and resets) or a DMA fault (raw status bit
12/13), each with a diagnostic naming task, register, rule and value."""

from __future__ import annotations

import json

import numpy as np
import pytest

from ggml_rknpu.hw.alignment import align_up
from ggml_rknpu.hw.regcmd import Target, fetch_amount, regcmd_word, task_tail, write_word
from ggml_rknpu.hw.registers import REGISTERS
from ggml_rknpu.sim.npu import SimNpu
from support.sim_support import REGCMD_ADDR, FakeMemory, pack_feature, pack_weights, vendor_submit

FEATURE, WEIGHTS, OUTPUT = 0x1000_0000, 0x2000_0000, 0x3000_0000
INT_STATUS, RAW_STATUS = 0x28, 0x2C
pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def golden(reference_dir):
    """Body words (tail stripped) of golden cases: fp16->fp32 M=4 K=32 N=16, and 384x384x4096."""
    cases = json.loads((reference_dir / "golden" / "mtx512-single-task.json").read_text())["cases"]
    bodies = {}
    for c in cases:
        words = [int(w, 16) for w in c["words"]]
        bodies[(c["mode"], c["M"], c["K"], c["N"])] = words[:-4]
    return bodies


def small(golden) -> list[int]:
    return list(golden[("fp16_fp32", 4, 32, 16)])


def off(name: str) -> int:
    return REGISTERS[name].offset


def set_reg(body: list[int], name: str, value: int) -> list[int]:
    """Replace the write of register ``name`` with ``value`` (exactly one write expected)."""
    hits = [i for i, w in enumerate(body) if w and w & 0xFFFF == off(name)]
    assert len(hits) == 1, (name, hits)
    out = list(body)
    out[hits[0]] = write_word(name, value)
    return out


def drop_reg(body: list[int], name: str) -> list[int]:
    return [0 if w and w & 0xFFFF == off(name) else w for w in body]


def memory(m=4, k=32, n=16) -> FakeMemory:
    mem = FakeMemory()
    rng = np.random.default_rng(0)
    a = rng.standard_normal((m, k)).astype(np.float16)
    b = rng.standard_normal((n, k)).astype(np.float16)
    mem.map(FEATURE, a.nbytes)[:] = pack_feature(a, 8).view(np.uint8)
    mem.map(WEIGHTS, b.nbytes)[:] = pack_weights(b, 16).view(np.uint8)
    mem.map(OUTPUT, m * n * 4)
    mem.map(REGCMD_ADDR, 1 << 16)
    return mem


def place(mem: FakeMemory, tasks: list[list[int]], enable: int = 0x0D) -> list[int]:
    """Write tasks with chaining tails at 64-byte aligned slots; returns their addresses."""
    addrs, addr = [], REGCMD_ADDR
    for body in tasks:
        addrs.append(addr)
        addr += align_up((len(body) + 4) * 8, 64)
    for i, body in enumerate(tasks):
        nxt = (addrs[i + 1], len(tasks[i + 1])) if i + 1 < len(tasks) else (0, 0)
        words = np.array(body + task_tail(*nxt, enable), dtype=np.uint64)
        mem.view(addrs[i], words.nbytes)[:] = words.view(np.uint8)
    return addrs


def run(mem: FakeMemory, tasks: list[list[int]], *, int_mask: int = 0x300,
        task_number: int | None = None, words_override: list[int] | None = None) -> SimNpu:
    place(mem, tasks)
    if words_override is not None:
        words = np.array(words_override, dtype=np.uint64)
        mem.view(REGCMD_ADDR, words.nbytes)[:] = words.view(np.uint8)
    npu = SimNpu(mem)
    vendor_submit(npu, 0, REGCMD_ADDR, len(tasks[0]),
                  task_number if task_number is not None else len(tasks), int_mask, int_mask)
    return npu


def assert_hang(npu: SimNpu, *needles: str) -> str:
    assert npu.mmio_read(0, INT_STATUS) == 0, "a hang raises no completion interrupt"
    diag = npu.diagnostics(0)
    assert len(diag) == 1, diag
    for needle in needles:
        assert needle in diag[0], (needle, diag[0])
    return diag[0]


def test_valid_program_completes(golden):
    npu = run(memory(), [small(golden)])
    assert npu.diagnostics(0) == [] and npu.mmio_read(0, INT_STATUS) == 0x100


def test_cbuf_bank_overflow(golden):
    body = set_reg(small(golden), "CNA_CBUF_CON0", 0x76)          # 7 weight + 6 data banks
    d = assert_hang(run(memory(), [body]), "task 0", "cbuf-banks", "CNA_CBUF_CON0=0x00000076",
                    "13 exceeds the 12 CBUF banks", "ETIMEDOUT")
    assert "resets" in d


def test_input_larger_than_data_banks(golden):
    body = set_reg(golden[("fp16_fp32", 384, 384, 4096)], "CNA_CBUF_CON0", 0xB1)
    assert_hang(run(memory(), [body]), "cbuf-input", "384x1x384 fp16 = 294912 B",
                "DATA_BANK=1 (32768 B)")


def test_field_out_of_range(golden):
    body = set_reg(small(golden), "CNA_DATA_SIZE0", (1 << 16) | 2048)   # H=2048 > 11 bits
    assert_hang(run(memory(), [body]), "field-range", "CNA_DATA_SIZE0=0x00010800",
                "reserved bits 0x00000800", "DATAIN_HEIGHT[10:0]")


def test_missing_tail_op_enable(golden):
    mem = memory()
    body = small(golden)
    npu = run(mem, [body], words_override=body + [0, 0, regcmd_word(Target.MARKER, 0, 0), 0])
    assert_hang(npu, "missing-tail", "no op-enable word among the 108 words")


def test_fetch_amount_too_small_cuts_the_tail(golden):
    mem = memory()
    body = small(golden)
    place(mem, [body])
    npu = SimNpu(mem)
    vendor_submit(npu, 0, REGCMD_ADDR, len(body) - 10, 1)     # kernel told a shorter body
    assert_hang(npu, "missing-tail", "PC_REGISTER_AMOUNTS too small")


def test_missing_marker(golden):
    body = small(golden)
    tail = task_tail(0, 0, 0x0D)
    npu = run(memory(), [body], words_override=body + [tail[0], tail[1], 0, tail[3]])
    assert_hang(npu, "missing-marker", "0x0041_0000_0000_0000 marker")


def test_unmapped_feature_address_is_a_dma_read_fault(golden):
    body = set_reg(small(golden), "CNA_FEATURE_DATA_ADDR", 0x5000_0000)
    npu = run(memory(), [body])
    assert npu.mmio_read(0, RAW_STATUS) & 0x1000                  # DMA read error [§3]
    assert_hang(npu, "DMA read fault", "CNA_FEATURE_DATA_ADDR=0x50000000", "0x50000000")


def test_unmapped_output_address_is_a_dma_write_fault(golden):
    body = set_reg(small(golden), "DPU_DST_BASE_ADDR", 0x6000_0000)
    npu = run(memory(), [body])
    assert npu.mmio_read(0, RAW_STATUS) & 0x2000                  # DMA write error [§3]
    assert_hang(npu, "DMA write fault", "DPU_DST_BASE_ADDR=0x60000000")


def test_unmapped_regcmd_is_a_dma_read_fault(golden):
    mem = memory()
    npu = SimNpu(mem)
    vendor_submit(npu, 0, 0x7000_0000, 104, 1)
    assert npu.mmio_read(0, RAW_STATUS) & 0x1000
    assert_hang(npu, "regcmd fetch", "0x70000000")


def test_unwritten_register_read(golden):
    body = drop_reg(small(golden), "DPU_DST_SURF_STRIDE")
    assert_hang(run(memory(), [body]), "unwritten-register", "DPU_DST_SURF_STRIDE",
                "never written since reset", "Rewrite the full register set")


def test_pingpong_inheritance_from_two_tasks_back(golden):
    """Task 2 omits DST_SURF_STRIDE; in ping-pong mode its register group still holds task
    0's value: a board would silently use it. The simulator names the hazard."""
    body = small(golden)
    tasks = [body, body, drop_reg(body, "DPU_DST_SURF_STRIDE")]
    npu = run(memory(), tasks)
    assert npu.executed_tasks(0) == 2
    assert_hang(npu, "task 2", "unwritten-register", "DPU_DST_SURF_STRIDE",
                "register group 0 still holds 0x00000040 from task 0", "ping-pong")


def test_int_mask_that_masks_the_completion(golden):
    npu = run(memory(), [small(golden)], int_mask=0xC00)          # PPU pair for a DPU task
    assert npu.mmio_read(0, RAW_STATUS) == 0x100
    assert_hang(npu, "int-mask", "PC_INTERRUPT_MASK=0x00000C00", "0x300")


def test_int_mask_not_a_whole_pair_is_flagged(golden):
    npu = run(memory(), [small(golden), small(golden)], int_mask=0x100)
    assert npu.mmio_read(0, INT_STATUS) == 0x100   # raised, but the vendor fuzz gives 0x300
    diag = npu.diagnostics(0)
    assert len(diag) == 1 and "int-mask" in diag[0] and "whole group pair" in diag[0], diag


def test_missing_dpu_rdma(golden):
    bs = REGISTERS["DPU_BS_CFG"].encode(BS_ALU_SRC=1, BS_ALU_ALGO=2, BS_RELU_BYPASS=1,
                                        BS_MUL_BYPASS=1)
    body = set_reg(small(golden), "DPU_BS_CFG", bs)
    assert_hang(run(memory(), [body]), "missing-dpu-rdma", "DPU_BS_CFG", "lacks DPU_RDMA")


def test_target_block_mismatch(golden):
    body = small(golden)
    i = next(i for i, w in enumerate(body) if w & 0xFFFF == off("DPU_DST_SURF_STRIDE"))
    body[i] = regcmd_word(Target.CNA, off("DPU_DST_SURF_STRIDE"), 0x40)
    assert_hang(run(memory(), [body]), "target-block", "target 0x0201 (CNA) writes 0x4024",
                "DPU register")


def test_task_number_beyond_the_chain(golden):
    npu = run(memory(), [small(golden)], task_number=2)
    assert npu.executed_tasks(0) == 1 and npu.mmio_read(0, 0x3C) == 1
    assert_hang(npu, "chain-ends", "TASK_NUMBER=2", "no task 1 to fetch")


def test_surface_add_breaks_the_s_rule(golden):
    body = set_reg(small(golden), "DPU_SURFACE_ADD", 0x80)        # fp32 out needs 4 x 4 = 0x100
    assert_hang(run(memory(), [body]), "surface-add", "SURF_ADD=8", "S=4")


def test_data_entries_disagree(golden):
    body = set_reg(small(golden), "CNA_CBUF_CON1", 7)
    assert_hang(run(memory(), [body]), "data-entries", "DATA_ENTRIES=7", "= 1")


def test_reset_after_a_hang_then_a_good_program_runs(golden):
    mem = memory()
    bad = set_reg(small(golden), "CNA_CBUF_CON0", 0x76)
    npu = run(mem, [bad])
    assert npu.mmio_read(0, INT_STATUS) == 0
    npu.soft_reset(0)
    assert npu.diagnostics(0)                           # kept for the kernel's report
    place(mem, [small(golden)])
    vendor_submit(npu, 0, REGCMD_ADDR, len(small(golden)), 1)
    assert npu.diagnostics(0) == [] and npu.mmio_read(0, INT_STATUS) == 0x100


def test_fetch_amount_of_the_vendor_kernel(golden):
    assert fetch_amount(len(small(golden))) == 53        # 104 body words -> 108 fetched


def test_weight_reuse_of_different_weights(golden):
    """WEIGHT_REUSE=1 keeps CBUF's weights; naming other weights would silently use the old."""
    body = small(golden)
    second = set_reg(set_reg(body, "CNA_CBUF_CON0", 0x20B1), "CNA_DCOMP_ADDR0", WEIGHTS + 0x400)
    npu = run(memory(), [body, second])
    assert npu.executed_tasks(0) == 1
    assert_hang(npu, "task 1", "weight-reuse", "CNA_DCOMP_ADDR0=0x20000000",
                "CNA_DCOMP_ADDR0=0x20000400", "old CBUF content", "silently")


def test_weight_reuse_after_streamed_weights(golden):
    body = set_reg(small(golden), "CNA_CBUF_CON0", 0x01)      # 0 weight banks: refused earlier
    assert_hang(run(memory(), [body]), "cbuf-banks", "both need at least one bank")
    big = golden[("fp16_fp32", 384, 384, 4096)]                # 3 MiB of weights, 3 banks
    reuse = set_reg(big, "CNA_CBUF_CON0", 0x2039)
    npu = run(memory(384, 384, 4096), [big, reuse])
    assert_hang(npu, "task 1", "weight-reuse", "streamed them")


def test_weight_reuse_of_resident_weights_is_accepted(golden):
    body = small(golden)
    npu = run(memory(), [body, set_reg(body, "CNA_CBUF_CON0", 0x20B1)])
    conv = npu.trace(0)[1].conv
    assert npu.diagnostics(0) == [] and conv is not None and conv.weight_reuse


@pytest.mark.parametrize("register, fields", [
    ("DPU_FEATURE_MODE_CFG", dict(BURST_LEN=15, OUTPUT_MODE=2, TP_EN=1)),
    ("CNA_CONV_CON1", dict(PROC_PRECISION=1, IN_PRECISION=1)),           # int16
    ("CNA_CONV_CON3", dict(CONV_X_STRIDE=2, CONV_Y_STRIDE=1)),
])
def test_outside_the_model_says_so(golden, register, fields):
    """Legal-looking settings the simulator does not implement stop with a 'not modeled'
    diagnostic, never with a result and never as a claimed hardware rule."""
    body = set_reg(small(golden), register, REGISTERS[register].encode(**fields))
    d = assert_hang(run(memory(), [body]), "not modeled", "not a hardware verdict")
    assert "rule '" not in d
