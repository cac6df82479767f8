"""The vendor runtime's own register streams (captures/raw/*live_regcmd*), run through
SimNpu: the simulator must decode them into the convolution the log describes (shape,
strides, addresses, banks), execute every task chain the runtime prepared (1-, 2- and
3-core variants), accept the PPU "separator" tasks, and produce the numpy result.
Input and weight values were not captured; random ones are placed in the runtime's own
buffers. A 3x3 capture must stop with a model-limit diagnostic, not a rule violation."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest

from ggml_rknpu.hw.regcmd import Target, decode_word
from ggml_rknpu.hw.registers import REGISTERS
from ggml_rknpu.sim.npu import SimNpu
from support.sim_support import FakeMemory, pack_feature, pack_weights, unpack_output, vendor_submit, within_fp16_model

PC_BASE = REGISTERS["PC_BASE_ADDRESS"].offset


@dataclass
class Capture:
    gems: dict[str, tuple[int, int]]            # name -> (dma addr, aligned size)
    tasks: list[dict[str, int]]                 # the task table (GEM 1)
    words: dict[int, int]                       # dma address -> regcmd word
    input_dims: tuple[int, ...]                 # native (1, C1, H, W, C2)
    output_dims: tuple[int, ...]
    weight_shape: tuple[int, ...]               # (OC, IC, kh, kw)
    weight_addr: int


def parse(path: Path) -> Capture:
    text = path.read_text()
    gems = {m[1]: (int(m[2], 16), int(m[3])) for m in re.finditer(
        r"allocated memory, name: (\w+), .*?dma addr: (0x[0-9a-f]+), .*?aligned size: (\d+)", text)}
    gem1 = text.split("GEM 1:")[1].split("GEM 2:")[0]
    tasks = [{k: int(v, 0) for k, v in re.findall(r"(\w+)=(0x[0-9a-f]+|\d+)", line)}
             for line in gem1.splitlines() if "task_like[" in line]
    weight_dma = gems["weight"][0]
    words = {weight_dma + int(m[1], 16): int(m[2], 16) for m in re.finditer(
        r"regcmd_qword\[\d+\] off=(0x[0-9a-f]+) value=(0x[0-9a-f]+)", text)}
    dims = {m[1]: tuple(int(x) for x in m[2].split())
            for m in re.finditer(r"Native (input|output) dims: ([\d ]+)", text)}
    const = re.search(r"conv\.weight FLOAT16\s+\(([\d,]+)\) \| (0x[0-9a-f]+)", text)
    assert const is not None, "the capture log names no conv.weight constant"
    return Capture(gems, tasks, words, dims.get("input", ()), dims.get("output", ()),
                   tuple(int(x) for x in const[1].split(",")), int(const[2], 16))


def chains(cap: Capture) -> list[list[int]]:
    """Task chains as the in-stream tails link them (PC_BASE_ADDRESS of each task's tail)."""
    by_addr = {t["regcmd_addr"]: i for i, t in enumerate(cap.tasks)}
    nxt: dict[int, int] = {}
    for i, t in enumerate(cap.tasks):
        for j in range(t["regcfg_amount"] + 4):
            target, value, offset = decode_word(cap.words[t["regcmd_addr"] + 8 * j])
            if target == Target.PC and offset == PC_BASE and value in by_addr:
                nxt[i] = by_addr[value]
    heads = [i for i in range(len(cap.tasks)) if i not in nxt.values()]
    out = []
    for h in heads:
        chain = [h]
        while chain[-1] in nxt:
            chain.append(nxt[chain[-1]])
        out.append(chain)
    return out


def build_memory(cap: Capture, a: np.ndarray, b: np.ndarray) -> tuple[FakeMemory, np.ndarray]:
    mem = FakeMemory()
    bufs = {name: mem.map(dma, size) for name, (dma, size) in cap.gems.items()}
    weight_dma = cap.gems["weight"][0]
    for addr, word in cap.words.items():
        bufs["weight"][addr - weight_dma: addr - weight_dma + 8] = \
            np.array([word], dtype="<u8").view(np.uint8)
    packed_w = pack_weights(b, 16).view(np.uint8)
    off = cap.weight_addr - weight_dma
    bufs["weight"][off: off + packed_w.size] = packed_w
    packed_a = pack_feature(a, 8).view(np.uint8)
    bufs["input"][: packed_a.size] = packed_a
    return mem, bufs["output"]


def pointwise_case(reference_dir: Path, name: str):
    path = next((reference_dir / "captures" / "raw").glob(f"*{name}*live_regcmd*.log"))
    cap = parse(path)
    _, c1, h, w, c2 = cap.input_dims
    oc = cap.output_dims[1] * cap.output_dims[4]
    assert cap.weight_shape == (oc, c1 * c2, 1, 1)
    rng = np.random.default_rng(7)
    a = rng.standard_normal((h * w, c1 * c2)).astype(np.float16)     # M x K
    b = rng.standard_normal((oc, c1 * c2)).astype(np.float16)        # N x K
    return cap, a, b


def run_chain(cap: Capture, chain: list[int], mem: FakeMemory, core: int) -> SimNpu:
    npu = SimNpu(mem)
    first, last = cap.tasks[chain[0]], cap.tasks[chain[-1]]
    vendor_submit(npu, core, first["regcmd_addr"], first["regcfg_amount"], len(chain),
                  first["int_mask"], last["int_mask"])
    return npu


@pytest.mark.timeout(120)
@pytest.mark.parametrize("name", ["pw_c256_h14", "c64_h56"])
def test_pointwise_capture_runs_every_variant(reference_dir, name):
    """Every chain the runtime prepared computes its part of the same convolution; the
    1-core chain covers the whole output, the multi-core variants tile it exactly."""
    cap, a, b = pointwise_case(reference_dir, name)
    m, n = a.shape[0], b.shape[0]
    all_chains = chains(cap)
    assert sorted(i for ch in all_chains for i in ch) == list(range(len(cap.tasks)))
    coverage, reused = [], 0
    for index, chain in enumerate(all_chains):
        core = index % 3
        mem, out = build_memory(cap, a, b)
        out[:] = 0xFF                                   # fp16 NaN poison: marks unwritten
        npu = run_chain(cap, chain, mem, core)
        assert npu.diagnostics(core) == [], (chain, npu.diagnostics(core))
        assert npu.executed_tasks(core) == len(chain)
        assert npu.mmio_read(core, 0x28) & cap.tasks[chain[-1]]["int_mask"]   # completes
        got = unpack_output(out[: m * n * 2].view(np.float16), m, n, 8)
        written = ~np.isnan(got)
        ok = within_fp16_model(np.where(written, got, 0).astype(np.float16), a, b)
        assert ok[written].all(), f"chain {chain}: wrong values"
        coverage.append(written.mean())
        for rec, task_index in zip(npu.trace(core), chain):
            assert rec.enable_mask == cap.tasks[task_index]["enable_mask"]
            assert (rec.conv is not None) == (rec.enable_mask == 0x0D)
            assert (rec.pool is not None) == (rec.enable_mask == 0x60)
            reused += bool(rec.conv and rec.conv.weight_reuse)
    assert coverage[0] == 1.0                           # the 1-core variant: whole output
    # c64_h56's 1-core chain keeps its resident weights in CBUF for the second row tile
    assert reused == (1 if name == "c64_h56" else 0)
    rest = sum(coverage[1:])
    assert abs(rest - round(rest)) < 1e-9 and round(rest) >= 1   # other variants tile it


def test_pw_c256_h14_decodes_to_the_logged_convolution(reference_dir):
    """Task 0 of the vendor's pointwise conv is M=196 (14x14), K=256, N=512 fp16->fp16 at the
    buffers the runtime's tensor tables name, with the runtime's CBUF split."""
    cap, a, b = pointwise_case(reference_dir, "pw_c256_h14")
    mem, _ = build_memory(cap, a, b)
    npu = run_chain(cap, [0], mem, 0)
    conv = npu.trace(0)[0].conv
    assert conv is not None
    assert (conv.rows, conv.channels, conv.kernels) == (196, 256, 512)
    assert (conv.width, conv.height, conv.plane_height) == (14, 14, 14)
    assert (conv.stride_x, conv.stride_y, conv.kernel_w, conv.kernel_h) == (1, 1, 1, 1)
    assert (conv.precision, conv.out_precision) == ("fp16", "fp16")
    assert conv.feature_addr == cap.gems["input"][0] == 0xFFEF9000
    assert conv.weight_addr == cap.weight_addr == 0xFFF5C000
    assert conv.weight_bytes == 512 * 256 * 2
    assert conv.dst_addr == cap.gems["output"][0] == 0xFFEC8000
    assert conv.dst_plane_bytes == 196 * 16
    assert (conv.data_banks, conv.weight_banks) == (4, 8)
    assert conv.out_channels == 512


def test_pw_c256_h14_ppu_separator_is_accepted(reference_dir):
    """The 2-core variant's first chain (conv N 0..255, then a PPU task): the separator
    decodes to a 1x1x32 8-bit max pool from memory, completes with the PPU interrupt the
    task table's int_mask 0xC00 waits for, and copies its 32 bytes."""
    cap, a, b = pointwise_case(reference_dir, "pw_c256_h14")
    mem, _ = build_memory(cap, a, b)
    chain = next(ch for ch in chains(cap) if ch[0] == 1)
    assert chain == [1, 2] and cap.tasks[2]["enable_mask"] == 0x60
    src = cap.gems["weight"][0] + 0x40400
    scratch = np.arange(32, dtype=np.uint8) + 1
    mem.view(src, 32)[:] = scratch
    npu = run_chain(cap, chain, mem, 0)
    assert npu.diagnostics(0) == []
    pool = npu.trace(0)[1].pool
    assert pool is not None
    assert (pool.width, pool.height, pool.channels, pool.element_bytes) == (1, 1, 32, 1)
    assert pool.src_addr == src and pool.dst_addr == cap.gems["weight"][0] + 0x40000
    np.testing.assert_array_equal(mem.view(pool.dst_addr, 32), scratch)
    status = npu.mmio_read(0, 0x28)
    assert status == 0x800          # PPU group 1 (second task), masked by 0xC00


def test_3x3_capture_stops_at_a_model_limit_not_a_rule(reference_dir):
    """captures/raw/*h14_live_regcmd* is a 3x3 conv (160 -> 320 channels, 14x14 -> 12x12).
    The simulator executes only 1x1 kernels: it must say so, and find no rule broken."""
    path = next((reference_dir / "captures" / "raw").glob("*gems_h14_live_regcmd*.log"))
    cap = parse(path)
    assert cap.weight_shape == (320, 160, 3, 3)
    mem = FakeMemory()
    for dma, size in cap.gems.values():
        mem.map(dma, size)
    for addr, word in cap.words.items():
        mem.view(addr, 8)[:] = np.array([word], dtype="<u8").view(np.uint8)
    npu = run_chain(cap, chains(cap)[0], mem, 0)
    diag = npu.diagnostics(0)
    assert len(diag) == 1 and "not modeled" in diag[0] and "WEIGHT_WIDTH=3" in diag[0], diag
    assert "rule '" not in diag[0]
    assert npu.mmio_read(0, 0x28) == 0                  # no completion: a kernel would time out
