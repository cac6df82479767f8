"""The server with the real pieces behind it: the host backend (ggml-cpu through libggml) and the
engine on the simulated NPU (``ggml_rknpu.open("sim-rknpu")``), driven over the wire."""

from __future__ import annotations

import numpy as np
import pytest
from gguf import GGMLQuantizationType
from gguf.quants import dequantize, quantize

from ggml_rknpu.engine.api import NpuEngine
from ggml_rknpu.libggml.enums import GgmlOp, GgmlType
from ggml_rknpu.server.placement import HOST, NPU
from support.rpc_testkit import T, serve

pytestmark = pytest.mark.timeout(180)
K, N, M = 64, 48, 5


@pytest.fixture(scope="module")
def engines():
    """open(device) once per module."""
    import ggml_rknpu

    opened: dict[str, NpuEngine] = {}

    def get(device: str):
        if device not in opened:
            opened[device] = ggml_rknpu.open(device)
        return opened[device]

    yield get
    for npu in opened.values():
        npu.close()


SIM_DEVICES = ["sim-rknpu", "sim-rocket"]


def fp16(w: np.ndarray) -> np.ndarray:
    return w.astype(np.float16).astype(np.float32)


def f32(buffer, data, *ne, **kw) -> T:
    return T(ne=tuple(ne) + (1,) * (4 - len(ne)), buffer=buffer, data=data, **kw)


def _graph(c, wq: np.ndarray, w_type: int, k: int):
    """out = x @ W^T + bias, W quantized in a weights buffer."""
    wh, wb = c.alloc_base(1 << 16)
    ch, cb = c.alloc_base(1 << 16)
    w = T(ne=(k, N, 1, 1), buffer=wh, data=wb, type=w_type, name="blk.0.attn_q.weight")
    c.set_tensor(w, wq.tobytes())
    x = f32(ch, cb, k, M, name="x")
    mm = f32(ch, cb + 8192, N, M, op=int(GgmlOp.MUL_MAT), src=(w.id, x.id), name="mm")
    bias = f32(ch, cb + 16384, N, M, name="bias")
    out = f32(ch, cb + 24576, N, M, op=int(GgmlOp.ADD), src=(mm.id, bias.id), name="out")
    return x, bias, out, [mm, out], [w, x, mm, bias, out]


@pytest.mark.parametrize("device", ["host", *SIM_DEVICES])
def test_quantized_matmul_plus_add_with_real_ops(engines, device):
    npu = engines(device) if device != "host" else None
    rng = np.random.default_rng(0)
    k = 256
    w_float = rng.standard_normal((N, k)).astype(np.float32)
    wq = quantize(w_float, GGMLQuantizationType.Q8_0)
    w_deq = dequantize(wq, GGMLQuantizationType.Q8_0).astype(np.float32)
    xv = rng.standard_normal((M, k)).astype(np.float32)
    bv = rng.standard_normal((M, N)).astype(np.float32)
    def act(x: np.ndarray) -> np.ndarray:
        """ggml-cpu's Q8_0 matmul quantizes the activations to Q8_0 (its vec_dot type); the NPU takes them as they are."""
        if npu:
            return x
        q8 = GGMLQuantizationType.Q8_0
        return dequantize(quantize(x, q8), q8).astype(np.float32)

    with serve(npu=npu) as st:
        with st.client() as c:
            x, bias, out, nodes, tensors = _graph(c, wq, int(GgmlType.Q8_0), k)
            c.set_array(x, xv)
            c.set_array(bias, bv)
            c.graph_compute(nodes, tensors)
            got = c.get_array(out)
            ref = act(xv) @ (fp16(w_deq) if npu else w_deq).T + bv
            np.testing.assert_allclose(got, ref, rtol=2e-3, atol=2e-2)
            c.set_array(x, 2 * xv)                       # replay with a new input
            c.graph_recompute()
            ref2 = act(2 * xv) @ (fp16(w_deq) if npu else w_deq).T + bv
            np.testing.assert_allclose(c.get_array(out), ref2, rtol=2e-3, atol=4e-2)
        assert st.alive()
        engine = NPU if npu else HOST
        assert st.state.stats.per_op[("MUL_MAT", engine)].ops == 2
        assert st.state.stats.plans_built == 1
        if npu:
            assert st.state.weight_stats.uploads == 1


@pytest.mark.parametrize("device", SIM_DEVICES)
def test_sim_engine_weight_invalidation(engines, device):
    sim_npu = engines(device)
    rng = np.random.default_rng(1)
    w1, w2 = (rng.standard_normal((N, K)).astype(np.float32) for _ in range(2))
    xv = rng.standard_normal((M, K)).astype(np.float32)
    with serve(npu=sim_npu) as st:
        with st.client() as c:
            x, bias, out, nodes, tensors = _graph(c, w1, int(GgmlType.F32), K)
            c.set_array(x, xv)
            c.set_array(bias, np.zeros((M, N), np.float32))
            c.graph_compute(nodes, tensors)
            np.testing.assert_allclose(c.get_array(out), xv @ fp16(w1).T, rtol=2e-3, atol=2e-2)
            c.set_array(tensors[0], w2)                              # rewrite the weight
            c.graph_recompute()
            np.testing.assert_allclose(c.get_array(out), xv @ fp16(w2).T, rtol=2e-3, atol=2e-2)
        assert st.state.weight_stats.uploads == 2 and st.state.weight_stats.invalidations == 1
