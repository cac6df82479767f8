"""The simulator's host cost of large buffers, and that cutting it changes nothing it models.

A large cached object's CPU view is a copy-on-write mapping of its DRAM (sim.memory
``GemObject``): checked op by op against two separate copies (the model), including stale
data after a missing sync, and that a written and synced weight costs its size once.
Decoded weights are kept only from their second read (sim.conv ``SEEN_KEYS``)."""

from __future__ import annotations

import numpy as np

from ggml_rknpu.engine import open_engine, open_npu
from ggml_rknpu.engine.core_files import CoreFilesEngine
from ggml_rknpu.sim.kernel import SimKernel
from ggml_rknpu.sim.memory import PAGE, SHARED_VIEW_MIN_BYTES, GemObject
from ggml_rknpu.sim.npu import SimNpu

SIZE = SHARED_VIEW_MIN_BYTES + 3 * PAGE


def _rss() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) << 10 for line in f if line.startswith("VmRSS:"))


def _span(rng: np.random.Generator) -> tuple[int, int]:
    """Page-crossing, sub-page and whole-object ranges alike."""
    kind = rng.integers(3)
    if kind == 0:
        return 0, SIZE
    start = int(rng.integers(0, SIZE - 1))
    limit = 3 * PAGE if kind == 1 else SIZE - start
    return start, int(rng.integers(1, min(limit, SIZE - start) + 1))


def test_shared_views_show_what_two_copies_show_op_by_op():
    rng = np.random.default_rng(11)
    obj = GemObject(SIZE, 0, 0, cached=True)
    assert obj.private_cpu_pages == 0                 # a shared view: nothing private yet
    dram, cpu = np.zeros(SIZE, np.uint8), np.zeros(SIZE, np.uint8)     # the model
    for step in range(400):
        op = rng.integers(5)
        off, n = _span(rng)
        value = np.uint8(step % 251 + 1)
        if op == 0:                                   # the CPU writes through its mapping
            obj.cpu[off:off + n] = value
            cpu[off:off + n] = value
        elif op == 1:                                 # the NPU writes DRAM
            obj.prepare_device_write(off, n)
            obj.dram[off:off + n] = value
            dram[off:off + n] = value
        elif op == 2:
            obj.sync_for_device(off, n)
            dram[off:off + n] = cpu[off:off + n]
        elif op == 3:
            obj.sync_for_cpu(off, n)
            cpu[off:off + n] = dram[off:off + n]
        else:                                         # a partial clean (rocket's dirty lines)
            mask = np.zeros(SIZE, bool)
            mask[off:off + n] = rng.integers(2, size=n).astype(bool)
            obj.write_back(mask)
            dram[mask] = cpu[mask]
        assert np.array_equal(obj.dram, dram) and np.array_equal(obj.cpu, cpu), (step, op, off, n)


def test_a_missing_sync_still_shows_stale_data():
    obj = GemObject(SIZE, 0, 0, cached=True)
    obj.cpu[:] = 5
    assert not obj.dram.any()                         # no sync for the device: the NPU reads zeros
    obj.sync_for_device(0, SIZE)
    assert (obj.dram == 5).all() and obj.private_cpu_pages == 0
    obj.prepare_device_write(PAGE + 7, 10)
    obj.dram[PAGE + 7:PAGE + 17] = 9
    assert (obj.cpu == 5).all()                       # no sync for the CPU: it reads its stale copy
    obj.sync_for_cpu(0, SIZE)
    assert (obj.cpu[PAGE + 7:PAGE + 17] == 9).all()


def test_a_synced_weight_costs_its_size_once():
    size = 256 << 20
    before = _rss()
    obj = GemObject(size, 0, 0, cached=True)
    obj.cpu[:] = 1                                    # the engine writes the weight ...
    obj.sync_for_device(0, size)                      # ... and cleans it for the NPU
    grown = _rss() - before
    assert obj.private_cpu_pages == 0 and (obj.dram[::PAGE] == 1).all()
    assert grown < size * 5 // 4, f"{grown >> 20} MiB for a {size >> 20} MiB object"   # two copies: 512


def test_a_weight_read_once_leaves_no_decoded_copy_and_results_keep_their_bits():
    rng = np.random.default_rng(5)
    b = (rng.standard_normal((512, 256)) * 0.1).astype(np.float16)
    a = rng.standard_normal((3, 256)).astype(np.float32)
    with open_engine("sim-rknpu") as npu:
        kernel = npu.device.syscalls
        assert isinstance(kernel, SimKernel)
        w = npu.upload_weight(b, "fp16")
        first = npu.matmul(a, w)
        model = kernel._npu_model()
        assert isinstance(model, SimNpu)
        decoded = model.operands._weights
        assert decoded._bytes == 0                    # read once: decoded, used, dropped
        second = npu.matmul(a, w)
        assert decoded._bytes == 512 * 256 * 4        # read again: kept (fp32)
        third = npu.matmul(a, w)                      # from the decoded copy
        assert first.tobytes() == second.tobytes() == third.tobytes()
        np.testing.assert_allclose(first, a.astype(np.float16).astype(np.float32) @ b.astype(np.float32).T,
                                   rtol=2e-3, atol=2e-3)


def test_a_weight_on_sim_rocket_costs_its_size_once_in_every_file():
    """Rocket's BOs are all CPU-cached and synced by dirty lines: the kernel's record of a
    weight's synced bytes is DRAM itself until the NPU writes the BO, not a second copy."""
    b = np.ones((6144, 8192), np.float16)             # 96 MiB, a slice in each of three files
    with open_npu("sim-rocket", envelope="extended") as npu:
        assert isinstance(npu, CoreFilesEngine) and npu.cores == 3
        before = _rss()
        w = npu.upload_weight(b, "fp16")
        grown = _rss() - before
        a = np.ones((2, 8192), np.float32)
        assert (npu.matmul(a, w) == 8192).all()       # the slices read back as written
    assert w.packed_bytes >= b.nbytes
    assert grown < b.nbytes * 5 // 4, f"{grown >> 20} MiB for a {b.nbytes >> 20} MiB weight"   # two copies: 192
