"""Property tests of the simulator's reading of the registers, on random shapes: a matmul
folded as H x W (W > 1), tiled by rows into chained tasks whose feature/output bases move
inside full-height planes (SURF_STRIDE / DST_SURF_STRIDE keep the full plane), with N not a
multiple of the kernel group and padded output planes. The register values are written
here from the §7 recipe onto a golden template (independently of ggml_rknpu.compiler)."""

from __future__ import annotations

import json

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ggml_rknpu.hw.alignment import align_up, ceil_div
from ggml_rknpu.hw.regcmd import task_tail, write_word
from ggml_rknpu.hw.registers import REGISTERS
from ggml_rknpu.sim.npu import SimNpu
from support.sim_support import (
    REGCMD_ADDR,
    FakeMemory,
    pack_feature,
    pack_weights,
    unpack_output,
    vendor_submit,
    within_fp16_model,
)

FEATURE, WEIGHTS, OUTPUT = 0x1000_0000, 0x2000_0000, 0x3000_0000
MODES = {"fp16_fp32": ("fp16", np.float16, np.float32, 16, 4),
         "fp16_fp16": ("fp16", np.float16, np.float16, 16, 2),
         "int8_int32": ("int8", np.int8, np.int32, 32, 8)}   # ..., kernel group, S [§7]


@pytest.fixture(scope="module")
def templates(reference_dir):
    cases = json.loads((reference_dir / "golden" / "mtx512-single-task.json").read_text())["cases"]
    return {c["mode"]: [int(w, 16) for w in c["words"]][:-4] for c in cases if c["M"] == 1}


def set_fields(body: list[int], values: dict[str, dict[str, int] | int]) -> list[int]:
    out = list(body)
    for name, v in values.items():
        reg = REGISTERS[name]
        value = v if isinstance(v, int) else reg.encode(**v)
        hits = [i for i, w in enumerate(out) if w and w & 0xFFFF == reg.offset]
        assert len(hits) == 1, name
        out[hits[0]] = write_word(name, value)
    return out


def task_body(template, mode, *, w, h, hf, k, n, row0, plane_atoms):
    prec, _, out_dt, group, s = MODES[mode]
    b = 1 if prec == "int8" else 2
    ob = np.dtype(out_dt).itemsize
    np_ = align_up(n, group)
    data_banks = ceil_div(h * w * k * b, 32768)
    return set_fields(template, {
        "CNA_CONV_CON2": {"FEATURE_GRAINS": h + 1},
        "CNA_DATA_SIZE0": {"DATAIN_WIDTH": w, "DATAIN_HEIGHT": h},
        "CNA_DATA_SIZE1": {"DATAIN_CHANNEL_REAL": k - 1, "DATAIN_CHANNEL": k},
        "CNA_DATA_SIZE2": {"DATAOUT_WIDTH": w},
        "CNA_DATA_SIZE3": {"DATAOUT_ATOMICS": w * h},
        "CNA_WEIGHT_SIZE0": n * k * b,
        "CNA_WEIGHT_SIZE1": {"WEIGHT_BYTES_PER_KERNEL": k * b},
        "CNA_WEIGHT_SIZE2": {"WEIGHT_WIDTH": 1, "WEIGHT_HEIGHT": 1, "WEIGHT_KERNELS": n},
        "CNA_CBUF_CON0": {"WEIGHT_BANK": 12 - data_banks, "DATA_BANK": data_banks},
        "CNA_CBUF_CON1": {"DATA_ENTRIES": ceil_div(w * k * b, 64)},
        "CNA_FEATURE_DATA_ADDR": FEATURE + row0 * w * 16,
        "CNA_DMA_CON1": {"LINE_STRIDE": 4 * w},
        "CNA_DMA_CON2": {"SURF_STRIDE": (w * (hf - 4)) % (1 << 28)},
        "CNA_FC_DATA_SIZE0": {"DMA_WIDTH": w, "DMA_HEIGHT": h},
        "CNA_FC_DATA_SIZE1": {"DMA_CHANNEL": k},
        "CNA_DCOMP_ADDR0": WEIGHTS,
        "CORE_DATAOUT_SIZE_0": {"DATAOUT_HEIGHT": h - 1, "DATAOUT_WIDTH": w - 1},
        "CORE_DATAOUT_SIZE_1": {"DATAOUT_CHANNEL": np_ - 1},
        "DPU_DST_BASE_ADDR": OUTPUT + row0 * w * 16,
        "DPU_DST_SURF_STRIDE": {"DST_SURF_STRIDE": plane_atoms},
        "DPU_DATA_CUBE_WIDTH": {"WIDTH": w - 1},
        "DPU_DATA_CUBE_HEIGHT": {"HEIGHT": h - 1},
        "DPU_DATA_CUBE_CHANNEL": {"ORIG_CHANNEL": n - 1, "CHANNEL": np_ - 1},
        "DPU_WDMA_SIZE_0": {"CHANNEL_WDMA": np_ - 1},
        "DPU_WDMA_SIZE_1": {"HEIGHT_WDMA": h - 1, "WIDTH_WDMA": w - 1},
        "DPU_SURFACE_ADD": {"SURF_ADD": plane_atoms * s},
    }), np_ // (16 // ob)


def pack_weights_partial(b_nk: np.ndarray, group: int) -> np.ndarray:
    """Full kernel groups as §6; a partial last group packed with its real size (the
    inference the simulator documents: WEIGHT_BYTES = kernels x bytes per kernel)."""
    n, k = b_nk.shape
    full = n // group * group
    tail = b_nk[full:].reshape(n - full, k // 32, 32).transpose(1, 0, 2).reshape(-1)
    return np.concatenate([pack_weights(b_nk[:full], group), tail])


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(mode=st.sampled_from(sorted(MODES)), w=st.sampled_from([1, 2, 5]),
       hf=st.integers(1, 40), k32=st.integers(1, 6), n=st.integers(1, 70),
       tiles=st.integers(1, 4), pad_atoms=st.integers(0, 3), seed=st.integers(0, 2**16))
def test_tiled_chain_matches_numpy(templates, mode, w, hf, k32, n, tiles, pad_atoms, seed):
    prec, in_dt, out_dt, group, _ = MODES[mode]
    k, m = 32 * k32, hf * w
    tiles = min(tiles, hf)
    bounds = np.linspace(0, hf, tiles + 1).astype(int)
    plane_atoms = m + pad_atoms
    rng = np.random.default_rng(seed)
    if prec == "int8":
        a = rng.integers(-128, 128, size=(m, k), dtype=np.int8)
        b = rng.integers(-128, 128, size=(n, k), dtype=np.int8)
    else:
        a = rng.standard_normal((m, k)).astype(np.float16)
        b = rng.standard_normal((n, k)).astype(np.float16)
    bodies = []
    for r0, r1 in zip(bounds[:-1], bounds[1:]):
        body, n_planes = task_body(templates[mode], mode, w=w, h=int(r1 - r0), hf=hf, k=k, n=n,
                                   row0=int(r0), plane_atoms=plane_atoms)
        bodies.append(body)
    mem = FakeMemory()
    mem.map(FEATURE, a.nbytes)[:] = pack_feature(a, 16 // a.itemsize).view(np.uint8)
    mem.map(WEIGHTS, b.nbytes)[:] = pack_weights_partial(b, group).view(np.uint8)
    out = mem.map(OUTPUT, n_planes * plane_atoms * 16)
    regcmd = mem.map(REGCMD_ADDR, 4096 * len(bodies))
    for i, body in enumerate(bodies):
        nxt = (REGCMD_ADDR + 4096 * (i + 1), len(bodies[i + 1])) if i + 1 < len(bodies) else (0, 0)
        words = np.array(body + task_tail(*nxt, 0x0D), dtype=np.uint64).view(np.uint8)
        regcmd[4096 * i: 4096 * i + words.size] = words
    npu = SimNpu(mem)
    vendor_submit(npu, 0, REGCMD_ADDR, len(bodies[0]), len(bodies))
    assert npu.diagnostics(0) == [] and npu.executed_tasks(0) == len(bodies)
    c2 = 16 // np.dtype(out_dt).itemsize
    got = unpack_output(out.view(out_dt), m, n_planes * c2, c2, plane_atoms * c2)
    assert not got[:, n:].any()                     # padded channels are written as zero
    got = got[:, :n]
    if prec == "int8":
        np.testing.assert_array_equal(got, a.astype(np.int64) @ b.astype(np.int64).T)
    else:
        assert within_fp16_model(got, a, b).all()
