"""More than one IOMMU domain of weights on the simulated vendor driver: with the window shrunk
(``RKNPU_SIM_IOVA_BYTES``), weights larger than one domain stay NPU-resident across several,
each job in its weight's domain, and the results are exact [docs/npu-programming.md §4
"IOMMU domains"]."""

from __future__ import annotations

import numpy as np
import pytest

from ggml_rknpu.devices import open_device
from ggml_rknpu.engine import NpuEngine
from ggml_rknpu.sim.memory import WINDOW_ENV

WINDOW = 1 << 20   # bytes per domain
N, K = 256, 1024   # an int8 weight of 256 KiB


@pytest.fixture
def shrunk(monkeypatch):
    monkeypatch.setenv(WINDOW_ENV, str(WINDOW))
    engine = NpuEngine(open_device("sim-rknpu"), envelope="extended")   # chains of several programs
    yield engine
    engine.close()
    engine.device.close()


def test_weights_larger_than_one_domain_are_resident_across_several_and_exact(shrunk):
    rng = np.random.default_rng(3)
    bs = [rng.integers(-128, 128, (N, K), dtype=np.int8) for _ in range(10)]
    ws = [shrunk.upload_weight(b, dtype="int8") for b in bs]
    assert sum(w.packed_bytes for w in ws) > 2 * WINDOW
    domains = [w.domain for w in ws]
    assert domains == sorted(domains) and len(set(domains)) >= 3   # filled in order: 0, then 1, ...
    a = rng.integers(-128, 128, (5, K), dtype=np.int8)
    for _ in range(2):   # replayed: the device switches domain per job
        for w, b in zip(ws, bs):
            np.testing.assert_array_equal(shrunk.matmul(a, w), a.astype(np.int32) @ b.astype(np.int32).T)
    sim = shrunk.device.syscalls
    assert sim.domain_switches >= 2 * len(set(domains))   # type: ignore[attr-defined]


def test_a_fusion_of_weights_in_different_domains_is_refused_and_each_still_runs(shrunk):
    rng = np.random.default_rng(4)
    bs = [rng.integers(-128, 128, (N, K), dtype=np.int8) for _ in range(6)]
    ws = [shrunk.upload_weight(b, dtype="int8") for b in bs]
    apart = [ws[0], next(w for w in ws if w.domain != ws[0].domain)]
    with pytest.raises(ValueError, match="different IOMMU domains"):
        shrunk.fuse(apart, 4)
    same = [w for w in ws if w.domain == ws[0].domain][:2]
    a = rng.integers(-128, 128, (3, K), dtype=np.int8)
    outs = shrunk.fuse(same, 4).run(a)
    for out, w in zip(outs, same):
        np.testing.assert_array_equal(out, a.astype(np.int32) @ bs[ws.index(w)].astype(np.int32).T)
