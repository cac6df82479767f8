"""Shared A/C scratch buffers of the engine (one A and one C buffer per M bucket, grown to
the largest program): results stay exact when programs share and after a buffer grows,
memory held for A/C does not scale with the number of cached programs, freeing or evicting
one weight's programs keeps the others working, and running out of memory stays clear.
int8 x int8 -> int32 so every comparison with numpy is exact."""

from __future__ import annotations

import numpy as np
import pytest

from ggml_rknpu.engine import NpuEngine, bound_program, open_engine
from ggml_rknpu.engine.programs import RESERVE_ROWS
from ggml_rknpu.kernel.errors import NpuOutOfMemory

pytestmark = pytest.mark.timeout(300)


def _ints(rng, shape) -> np.ndarray:
    return rng.integers(-128, 128, shape, dtype=np.int8)


def _exact(npu: NpuEngine, a: np.ndarray, w, b: np.ndarray) -> None:
    np.testing.assert_array_equal(npu.matmul(a, w), a.astype(np.int32) @ b.astype(np.int32).T)


def _small_engine(limit: int) -> NpuEngine:
    from ggml_rknpu.kernel.device import NpuDevice
    from ggml_rknpu.sim.kernel import SimKernel

    sim = SimKernel("rknpu", memory_limit=limit)
    path = sim._device_paths()[-1]
    return NpuEngine(NpuDevice(sim, sim.open(path), path, simulated=True))


@pytest.mark.parametrize("device", ("sim-rknpu", "sim-rocket"))
def test_shared_scratch_is_exact_across_weights_buckets_and_growth(device):
    rng = np.random.default_rng(1)
    with open_engine(device) as npu:
        b_small, b_big = _ints(rng, (40, 64)), _ints(rng, (300, 200))
        small, big = npu.upload_weight(b_small, "int8"), npu.upload_weight(b_big, "int8")
        a_small, a_big = _ints(rng, (3, 64)), _ints(rng, (3, 200))
        _exact(npu, a_small, small, b_small)                  # bucket 4: small A and C buffers
        bound = small.programs[(4, "int32")]
        assert bound.a_buf is not None and bound.c_buf is not None
        a_addr, c_addr = bound.a_buf.dma_addr, bound.c_buf.dma_addr
        _exact(npu, a_big, big, b_big)                        # same bucket, larger A and C: it grows once
        assert npu.counters["scratch_grown"] == 1
        assert bound.a_buf.scratch is bound.c_buf.scratch      # one buffer: A, then C
        assert bound.c_buf.offset % 64 == 0 and bound.c_buf.offset >= big.programs[(4, "int32")].program.a_bytes
        assert (bound.a_buf.dma_addr, bound.c_buf.dma_addr) != (a_addr, c_addr)   # re-bound
        big_c = big.programs[(4, "int32")].c_buf
        assert big_c is not None and big_c.scratch is bound.c_buf.scratch
        for _ in range(2):                                    # stale bytes of the other never leak in
            _exact(npu, a_small, small, b_small)
            _exact(npu, a_big, big, b_big)
        _exact(npu, _ints(rng, (1, 64)), small, b_small)      # other buckets have their own
        _exact(npu, _ints(rng, (70, 200)), big, b_big)
        assert set(npu.scratch.buckets) == {(0, 1), (0, 4), (0, 128)}


def test_steady_state_calls_neither_rebind_nor_allocate(monkeypatch):
    rng = np.random.default_rng(2)
    with open_engine("sim-rknpu") as npu:
        b1, b2 = _ints(rng, (48, 96)), _ints(rng, (80, 160))
        w1, w2 = npu.upload_weight(b1, "int8"), npu.upload_weight(b2, "int8")
        a1, a2 = _ints(rng, (5, 96)), _ints(rng, (5, 160))
        _exact(npu, a1, w1, b1)
        _exact(npu, a2, w2, b2)
        binds, allocs = [], []
        monkeypatch.setattr(bound_program.BoundProgram, "write_words", lambda self: binds.append(self))
        real_alloc = npu.device.alloc
        def counting_alloc(*a, **k):
            allocs.append(a)
            return real_alloc(*a, **k)

        monkeypatch.setattr(npu.device, "alloc", counting_alloc)
        for _ in range(3):
            _exact(npu, a1, w1, b1)
            _exact(npu, a2, w2, b2)
        assert binds == [] and allocs == []


def test_scratch_memory_does_not_scale_with_cached_programs():
    rng = np.random.default_rng(3)
    with open_engine("sim-rknpu") as npu:
        weights = [(b, npu.upload_weight(b, "int8")) for b in (_ints(rng, (256, 512)) for _ in range(6))]
        free0 = npu.memory_budget()[0]
        a = _ints(rng, (100, 512))
        _exact(npu, a, *weights[0][::-1])
        one = free0 - npu.memory_budget()[0]
        regcmd_buf = weights[0][1].programs[(128, "int32")].regcmd_buf
        assert regcmd_buf is not None
        regcmd = regcmd_buf.capacity
        for b, w in weights[1:]:
            _exact(npu, a, w, b)
        six = free0 - npu.memory_budget()[0]
        # only regcmd and the vendor driver's task BO of its job (a page) are per program
        assert six == one + 5 * (regcmd + 4096)
        program = weights[0][1].programs[(128, "int32")].program
        assert npu.scratch_bytes() < 2 * (program.a_bytes + program.c_bytes)
        assert npu.scratch_bytes() * 3 < 6 * (program.a_bytes + program.c_bytes)


def test_free_keeps_the_other_weights_programs_working():
    rng = np.random.default_rng(4)
    with open_engine("sim-rknpu") as npu:
        b1, b2 = _ints(rng, (64, 128)), _ints(rng, (200, 256))
        w1 = npu.upload_weight(b1, "int8")
        a1, a2 = _ints(rng, (6, 128)), _ints(rng, (6, 256))
        _exact(npu, a1, w1, b1)                               # also makes the device's task buffer
        w1.free()
        free0 = npu.memory_budget()[0]
        w1, w2 = npu.upload_weight(b1, "int8"), npu.upload_weight(b2, "int8")
        _exact(npu, a1, w1, b1)
        _exact(npu, a2, w2, b2)                               # grows the bucket's buffers
        w2.free()                                             # the grower goes; buffers stay for w1
        assert npu.scratch_bytes() > 0
        _exact(npu, a1, w1, b1)
        w1.free()                                             # last user: shared buffers freed
        assert npu.scratch_bytes() == 0 and not npu.scratch.buckets
        assert npu.memory_budget()[0] == free0


def test_growth_under_memory_pressure_evicts_and_stays_exact():
    """8 MiB device: growing the shared C buffer for a bigger program has to evict the LRU
    program, which was the only user of the old C buffer (so it is freed on the way)."""
    rng = np.random.default_rng(5)
    npu = _small_engine(8 << 20)
    b1, b2 = _ints(rng, (512, 1024)), _ints(rng, (2048, 1024))   # 0.5 MiB, 2 MiB
    w1, w2 = npu.upload_weight(b1, "int8"), npu.upload_weight(b2, "int8")
    a = _ints(rng, (256, 1024))
    _exact(npu, a, w1, b1)                                    # A 256 KiB, C 512 KiB
    filler = npu.upload_weight(np.ones((3 << 10, 1024), np.int8), "int8")   # 3 MiB
    _exact(npu, a, w2, b2)                                    # C needs 2 MiB: evicts w1's program
    assert npu.counters["programs_evicted"] >= 1 and not w1.programs
    _exact(npu, a, w2, b2)
    _exact(npu, _ints(rng, (2, 1024)), w1, b1)
    filler.free()
    npu.close()


def test_out_of_memory_while_growing_splits_along_m_and_loses_nothing():
    """A bucket above RESERVE_ROWS whose scratch does not fit (after evicting every cached
    program) halves the weight's largest bucket and the call runs as several submits: exact,
    and nothing held beyond what the smaller programs use. A bucket at or below RESERVE_ROWS
    that cannot fit is a clear error that loses nothing."""
    rng = np.random.default_rng(6)
    npu = _small_engine(8 << 20)
    b1 = _ints(rng, (512, 1024))
    w1 = npu.upload_weight(b1, "int8")
    a = _ints(rng, (256, 1024))
    _exact(npu, a, w1, b1)
    b_fill = _ints(rng, (5 << 10, 1024))
    filler = npu.upload_weight(b_fill, "int8")                # 5 MiB: C of M=256 (5 MiB more) cannot fit
    _exact(npu, a, filler, b_fill)
    assert npu.counters["memory_splits"] >= 1 and RESERVE_ROWS <= filler.max_program_m < 256
    assert npu.last_timing is not None
    assert npu.last_timing.submits > 1 and not w1.programs    # evicted on the way
    _exact(npu, a, w1, b1)
    hog = npu.upload_weight(np.ones((9 << 8, 1024), np.int8), "int8")   # 2.25 MiB: 256 KiB left, < one M=16 program
    with pytest.raises(NpuOutOfMemory, match="out of NPU memory allocating .* bytes for program M=16.*free weights"):
        npu.matmul(_ints(rng, (16, 1024)), filler)
    hog.free()
    _exact(npu, _ints(rng, (16, 1024)), filler, b_fill)       # the engine still works
    filler.free()
    _exact(npu, a, w1, b1)
    npu.close()


@pytest.mark.parametrize("device,cap_mib", [("sim-rknpu", 1), ("sim-rknpu", 2), ("sim-rknpu", 3), ("sim-rocket", 1)])
def test_resident_weights_under_a_cap_leave_room_for_their_matmuls(device, cap_mib):
    """--npu-memory: weights are staged only while the reserve for their programs (one shared
    scratch at RESERVE_ROWS, each weight's register commands and tables) stays free, so every
    resident weight then runs at 1 and RESERVE_ROWS rows without an out-of-memory (which the
    server would turn into a host fallback for good), and a round at one bucket once all are
    bound evicts nothing. Before the reserve, weights filled the cap and the first matmul failed."""
    rng = np.random.default_rng(7)
    npu = open_engine(device)
    npu.memory_cap = cap_mib << 20
    shapes = [(1024, 256), (256, 1024), (768, 256)] * 4      # N x K: 256-512 KiB fp16 each
    resident, refused = [], 0
    for n, k in shapes:
        b = rng.standard_normal((n, k)).astype(np.float32)
        try:
            resident.append((npu.upload_weight(b), b))
        except NpuOutOfMemory as exc:
            assert "kept for the matmul programs" in str(exc)
            refused += 1
    assert resident and refused, (len(resident), refused)
    assert npu.memory_used() + npu.reserve_bytes() <= npu.memory_cap
    for rows in ((1, RESERVE_ROWS), (RESERVE_ROWS,), (RESERVE_ROWS,)):
        evicted = npu.counters["programs_evicted"]
        for w, b in resident:
            for m in rows:
                a = rng.standard_normal((m, b.shape[1])).astype(np.float32)
                np.testing.assert_allclose(npu.matmul(a, w), a @ b.T, rtol=2e-2, atol=5e-2)
                assert npu.memory_used() <= npu.memory_cap
    assert npu.counters["programs_evicted"] == evicted   # one bucket's programs all fit side by side
    npu.close()
