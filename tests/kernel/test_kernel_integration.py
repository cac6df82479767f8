"""The whole kernel seam with the real NPU model: NpuDevice -> driver class -> SimKernel
(ioctl decode, PC programming sequence, completion rule) -> SimNpu, on both ABIs, with
hardware-validated golden matmul streams relocated to the buffers' NPU addresses."""

from __future__ import annotations

import json

import numpy as np
import pytest

from ggml_rknpu.devices import open_device
from ggml_rknpu.kernel.device import HwTask, Job
from ggml_rknpu.sim.kernel import SimKernel
from support.sim_support import pack_feature, pack_weights, unpack_output, within_fp16_model

pytestmark = pytest.mark.timeout(120)
GOLDEN_BASES = (0x1000_0000, 0x2000_0000, 0x3000_0000)  # feature, weights, output [golden/README.md]


def relocate(words: np.ndarray, bases: tuple[int, ...], targets: tuple[int, ...], sizes: tuple[int, ...]) -> np.ndarray:
    """Rebase every 32-bit register value that points into a golden buffer onto ours."""
    out = words.copy()
    values = (words >> np.uint64(16)) & np.uint64(0xFFFFFFFF)
    for base, target, size in zip(bases, targets, sizes):
        hit = (values >= base) & (values < base + size)
        assert hit.sum() == 1, "each golden buffer is addressed by exactly one register"
        new = values[hit] - np.uint64(base) + np.uint64(target)
        out[hit] = (words[hit] & ~np.uint64(0xFFFFFFFF << 16)) | (new << np.uint64(16))
    return out


@pytest.mark.parametrize("abi", ["rknpu", "rocket"])
@pytest.mark.parametrize("index", [0, 6, 11], ids=["fp16_fp32-1x32x16", "int8_int32-1x32x32", "fp16_fp16-1x32x16"])
def test_golden_stream_through_the_kernel_seam(reference_dir, abi, index):
    case = json.loads((reference_dir / "golden" / "mtx512-single-task.json").read_text())["cases"][index]
    m, k, n = case["M"], case["K"], case["N"]
    in_dt, out_dt, group = {"fp16_fp32": (np.float16, np.float32, 16), "int8_int32": (np.int8, np.int32, 32),
                            "fp16_fp16": (np.float16, np.float16, 16)}[case["mode"]]
    rng = np.random.default_rng(index)
    if in_dt is np.int8:
        a = rng.integers(-128, 128, size=(m, k), dtype=np.int8)
        b = rng.integers(-128, 128, size=(n, k), dtype=np.int8)
    else:
        a, b = rng.standard_normal((m, k)).astype(np.float16), rng.standard_normal((n, k)).astype(np.float16)
    words = np.array([int(w, 16) for w in case["words"]], dtype=np.uint64)
    out_bytes = m * n * np.dtype(out_dt).itemsize
    with open_device(f"sim-{abi}") as dev:
        feat, wts, out, regcmd = dev.alloc(a.nbytes), dev.alloc(b.nbytes), dev.alloc(out_bytes), \
            dev.alloc(words.nbytes, purpose="regcmd")
        feat.array()[:] = pack_feature(a, 16 // a.itemsize).view(np.uint8)
        wts.array()[:] = pack_weights(b, group).view(np.uint8)
        out.array()[:] = 0xAB
        out.sync_to_device()  # the poison must reach the device copy too
        regcmd.array(np.uint64)[:] = relocate(words, GOLDEN_BASES, (feat.dma_addr, wts.dma_addr, out.dma_addr),
                                              (a.nbytes, b.nbytes, out_bytes))
        done = dev.submit(Job(cores=((HwTask(regcmd.dma_addr, len(words) - 4),),), inputs=(feat, wts),
                              outputs=(out,)))
        assert done.task_counter == 1 and done.simulated
        got = unpack_output(out.array(out_dt), m, n, 16 // np.dtype(out_dt).itemsize)
        if in_dt is np.int8:
            np.testing.assert_array_equal(got, a.astype(np.int64) @ b.astype(np.int64).T)
        else:
            assert within_fp16_model(got, a, b).all()
        assert isinstance(dev.syscalls, SimKernel) and dev.syscalls.dmesg == []


@pytest.mark.parametrize("int_mask,message,dmesg", [
    (0x100, "invalid irq status 0x100", "require mask: 0x100"),  # half a pair: fuzzed to 0x300 != 0x100
    (0xC00, "no interrupt", "rule 'int-mask'"),  # PPU mask on a DPU task: the interrupt stays masked
])
def test_wrong_int_mask_on_the_real_model_times_out_with_diagnostics(reference_dir, int_mask, message, dmesg):
    from ggml_rknpu.kernel.errors import NpuTimeout

    case = json.loads((reference_dir / "golden" / "mtx512-single-task.json").read_text())["cases"][0]
    words = np.array([int(w, 16) for w in case["words"]], dtype=np.uint64)
    with open_device("sim-rknpu") as dev:
        bufs = [dev.alloc(n) for n in (64, 1024, 64)]
        regcmd = dev.alloc(words.nbytes, purpose="regcmd")
        regcmd.array(np.uint64)[:] = relocate(words, GOLDEN_BASES, tuple(b.dma_addr for b in bufs), (64, 1024, 64))
        with pytest.raises(NpuTimeout, match=message):
            dev.submit(Job(cores=((HwTask(regcmd.dma_addr, len(words) - 4, int_mask=int_mask),),)))
        kernel = dev.syscalls
        assert isinstance(kernel, SimKernel)
        assert any(dmesg in line for line in kernel.dmesg)
        assert any("soft reset" in line for line in kernel.dmesg)
        regcmd.array(np.uint64)[:] = relocate(words, GOLDEN_BASES, tuple(b.dma_addr for b in bufs), (64, 1024, 64))
        assert dev.submit(Job(cores=((HwTask(regcmd.dma_addr, len(words) - 4),),))).task_counter == 1  # recovered
