"""``--activations ggml`` (server/activations.py): NPU activations rounded as ggml-cpu rounds them.

Judged by ggml itself: the rounding equals ggml's quantize-then-dequantize of each vec_dot type,
the rounded rows times the dequantized weight give ggml-cpu's own ``vec_dot`` for every weight
type, and under the default ``fp16`` the NPU gets today's activations."""

from __future__ import annotations

import ctypes

import numpy as np
import pytest

from ggml_rknpu.hw.alignment import align_up
from ggml_rknpu.libggml import lib
from ggml_rknpu.libggml.enums import TYPE_TRAITS, GgmlOp, GgmlType
from ggml_rknpu.server.activations import ActivationRounding
from ggml_rknpu.server.rpc import report
from support.rpc_testkit import FakeNpu, FusingFakeNpu, T, serve

F32 = int(GgmlType.F32)
K = 512
# ggml_vec_dot_t (ggml-cpu.h): n, s, bs, x, bx, y, by, nrc
VecDot = ctypes.CFUNCTYPE(None, ctypes.c_int, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p, ctypes.c_size_t,
                          ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)


@pytest.fixture(scope="module")
def g() -> lib.Ggml:
    try:
        return lib.load()
    except lib.GgmlLibraryMissing as exc:
        pytest.skip(str(exc))


def activations(m: int, seed: int = 0) -> np.ndarray:
    """Rows with the outlier channels real models have (a few values far above the rest)."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((m, K)) * np.exp(rng.standard_normal(K))
    return x.astype(np.float32)


def quantize(g: lib.Ggml, type_: int, x: np.ndarray) -> np.ndarray:
    block, size = TYPE_TRAITS[GgmlType(type_)]
    out = np.zeros(x.size // block * size, np.uint8)
    from_float = g.from_float(type_)
    assert from_float is not None, f"ggml-cpu has no quantizer for type {type_}"
    from_float(x.ctypes.data, out.ctypes.data, x.size)
    return out


@pytest.mark.parametrize("weight,vec_dot", [("Q4_0", "Q8_0"), ("Q5_0", "Q8_0"), ("Q8_0", "Q8_0"),
                                            ("Q4_K", "Q8_K"), ("Q6_K", "Q8_K"), ("BF16", "BF16")])
def test_rounding_is_ggmls_quantize_then_dequantize_of_the_vec_dot_type(g, weight, vec_dot):
    rounder = ActivationRounding(g, "ggml").for_step(int(GgmlType[weight]), F32, 3 * K)
    assert rounder is not None and rounder.vec_dot_type == GgmlType[vec_dot]
    rows = activations(3)
    got = rounder(rows).copy()
    vdt = int(GgmlType[vec_dot])
    dequantize = g.dequantize_row_q8_K if vdt == GgmlType.Q8_K else g.to_float(vdt)
    want = np.zeros_like(rows)
    for r in range(3):                                  # ggml-cpu converts src1 one row at a time
        packed = quantize(g, vdt, rows[r])
        dequantize(packed.ctypes.data, want[r].ctypes.data, K)
    np.testing.assert_array_equal(got, want)
    assert np.abs(got - rows).max() > 1e-3 * np.abs(rows).max()       # it did round


WEIGHT_TYPES = ["Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "BF16"]


@pytest.mark.parametrize("weight", WEIGHT_TYPES)
def test_rounded_rows_times_the_dequantized_weight_are_ggml_cpus_dot_products(g, weight):
    """Q4_1/Q5_1 cover Q8_1, which ggml cannot dequantize (its blocks are reread as Q8_0)."""
    wt = int(GgmlType[weight])
    n = 8
    w = np.random.default_rng(1).standard_normal((n, K)).astype(np.float32)
    wq = quantize(g, wt, w).reshape(n, -1)
    w_deq = np.zeros((n, K), np.float32)
    to_float = g.to_float(wt)
    assert to_float is not None
    to_float(wq.ctypes.data, w_deq.ctypes.data, n * K)
    x = activations(1, seed=2)
    traits = g.ggml_get_type_traits_cpu(wt).contents
    xq = quantize(g, traits.vec_dot_type, x)
    vec_dot, s = VecDot(traits.vec_dot), ctypes.c_float()
    cpu = np.zeros(n)
    for i in range(n):
        vec_dot(K, ctypes.addressof(s), 0, wq[i].ctypes.data, 0, xq.ctypes.data, 0, 1)
        cpu[i] = s.value
    rounder = ActivationRounding(g, "ggml").for_step(wt, F32, K)
    assert rounder is not None
    ours = w_deq.astype(np.float64) @ rounder(x)[0].astype(np.float64)
    as_sent = w_deq.astype(np.float64) @ x[0].astype(np.float64)
    scale = np.abs(w_deq).max() * np.abs(x).sum()
    # Q8_1's vec_dots add the weight's min times the block's fp16 ``s`` (d * sum(qs), ggml-common.h),
    # not the sum of the dequantized values: no per-value rounding reproduces that last term exactly
    tolerance = 3e-5 if traits.vec_dot_type == GgmlType.Q8_1 else 1e-6
    err = np.abs(ours - cpu).max()
    assert err <= tolerance * scale, (ours, cpu)
    assert np.abs(as_sent - cpu).max() >= 10 * err                # without the rounding: far off


def test_no_rounding_in_fp16_mode_for_f32_f16_weights_or_non_f32_activations(g):
    q4_0, f16 = int(GgmlType.Q4_0), int(GgmlType.F16)
    assert ActivationRounding(g).mode == "fp16" and ActivationRounding(g).for_step(q4_0, F32, K) is None
    ggml = ActivationRounding(g, "ggml")
    assert ggml.for_step(F32, F32, K) is None and ggml.for_step(f16, F32, K) is None
    assert ggml.for_step(q4_0, f16, K) is None
    with pytest.raises(ValueError, match="expected one of"):
        ActivationRounding(g, "q8")


MUL_MAT = int(GgmlOp.MUL_MAT)
M, N = 2, 16


def dequantized(g: lib.Ggml, type_: int, wq: np.ndarray, n: int) -> np.ndarray:
    out = np.zeros((n, K), np.float32)
    to_float = g.to_float(type_)
    assert to_float is not None
    to_float(wq.ctypes.data, out.ctypes.data, n * K)
    return out


def ggml_rounded(g: lib.Ggml, weight_type: int, x: np.ndarray) -> np.ndarray:
    """``x`` through ggml's quantizer of the weight's vec_dot type and its dequantizer, row by row."""
    vdt = g.vec_dot_type(weight_type)
    dequantize = g.dequantize_row_q8_K if vdt == GgmlType.Q8_K else g.to_float(vdt)
    assert dequantize is not None
    out = np.zeros_like(x)
    for r in range(x.shape[0]):
        dequantize(quantize(g, vdt, x[r]).ctypes.data, out[r].ctypes.data, x.shape[1])
    return out


def run_matmuls(npu, mode: str | None, types: tuple[str, ...]) -> tuple[list[np.ndarray], dict, list[tuple]]:
    """``types`` weights (N x K each) times one f32 activation [M, K]: results, stats and per
    weight (what the fake engine computes from the activations as sent, and from them rounded
    by ggml). ``mode`` None: the reference server without an NPU (ggml-cpu for every op)."""
    rng = np.random.default_rng(5)
    x = activations(M, seed=6)
    with serve(npu=npu) as st:
        if mode is not None:
            st.state.activations = ActivationRounding(st.state.host, mode)
        with st.client() as c:
            wh, wb = c.alloc_base(1 << 20)
            ch, cb = c.alloc_base(1 << 16)
            a = T(ne=(K, M, 1, 1), buffer=ch, data=cb, name="attn_norm")
            c.set_array(a, x)
            weights, outs, as_sent = [], [], []
            offset = 0
            for i, name in enumerate(types):
                wtype = int(GgmlType[name])
                wq = quantize(st.state.host, wtype, rng.standard_normal((N, K)).astype(np.float32))
                w16 = dequantized(st.state.host, wtype, wq, N).astype(np.float16).astype(np.float32)
                as_sent.append((x @ w16.T, ggml_rounded(st.state.host, wtype, x) @ w16.T))
                wt = T(ne=(K, N, 1, 1), buffer=wh, data=wb + offset, type=wtype, name=f"w{i}")
                c.set_tensor(wt, wq.tobytes())
                offset += align_up(wq.nbytes, 64)
                weights.append(wt)
                outs.append(T(ne=(N, M, 1, 1), buffer=ch, data=cb + 8192 * (i + 1), op=MUL_MAT,
                              src=(wt.id, a.id), name=f"out{i}"))
            c.graph_compute(outs, [a, *weights, *outs])
            results = [c.get_array(o).reshape(M, N) for o in outs]
        return results, report.stats_dict(st.state), as_sent
    raise AssertionError("unreachable")


def test_server_rounds_under_ggml_and_leaves_fp16_as_it_was(g):
    types = ("Q4_0", "Q4_K")
    host, _, expected = run_matmuls(None, None, types)
    fp16_npu = FakeNpu()
    fp16, fp16_stats, _ = run_matmuls(fp16_npu, "fp16", types)
    rounded, stats, _ = run_matmuls(FakeNpu(), "ggml", types)
    assert fp16_npu.matmuls == 2 and fp16_stats["activations"] == {"mode": "fp16", "rounded_steps": {}}
    assert stats["activations"] == {"mode": "ggml", "rounded_steps": {"q8_0": 1, "q8_K": 1}}
    for name, ref, plain, ours, (want_plain, want_ours) in zip(types, host, fp16, rounded, expected):
        np.testing.assert_array_equal(plain, want_plain, err_msg=name)   # fp16: the activations as sent
        np.testing.assert_array_equal(ours, want_ours, err_msg=name)     # ggml: rounded by ggml
        # the fake engine's fp16 weights are all that is left between ours and ggml-cpu's result
        assert np.abs(ours - ref).max() * 10 <= np.abs(plain - ref).max(), name


def test_grouped_matmuls_share_one_rounding(g):
    """Q/K/V of one activation are one engine fusion only when their vec_dot types agree."""
    for types, groups in ((("Q4_0", "Q8_0"), 1), (("Q4_0", "Q4_K"), 0)):
        results, stats, expected = run_matmuls(FusingFakeNpu(), "ggml", types)
        assert stats["npu_groups_planned"] == groups, types
        for got, (_, want) in zip(results, expected):
            np.testing.assert_array_equal(got, want)
        _, stats, _ = run_matmuls(FusingFakeNpu(), "fp16", types)
        assert stats["npu_groups_planned"] == 1, types


def run_experts(npu, mode: str | None) -> tuple[np.ndarray, dict, np.ndarray, np.ndarray, np.ndarray]:
    """MUL_MAT_ID with Q8_0 experts [K, N, E], b [K, 1, TOK] (broadcast over the slots), ids
    [USED, TOK]: the result [TOK, USED, N], stats, and the dequantized experts, b and ids."""
    e, used, tok = 4, 2, 3
    rng = np.random.default_rng(7)
    ids = np.array([[2, 0], [0, 3], [2, 3]], np.int32)
    b = activations(tok, seed=8)
    with serve(npu=npu) as st:
        if mode is not None:
            st.state.activations = ActivationRounding(st.state.host, mode)
        g = st.state.host
        q8_0 = int(GgmlType.Q8_0)
        wq = quantize(g, q8_0, rng.standard_normal((e * N, K)).astype(np.float32))
        experts = dequantized(g, q8_0, wq, e * N).reshape(e, N, K)
        with st.client() as c:
            wh, wb = c.alloc_base(1 << 20)
            ch, cb = c.alloc_base(1 << 16)
            w = T(ne=(K, N, e, 1), buffer=wh, data=wb, type=q8_0, name="blk.0.ffn_up_exps.weight")
            bt = T(ne=(K, 1, tok, 1), buffer=ch, data=cb, name="b")
            it = T(ne=(used, tok, 1, 1), buffer=ch, data=cb + 8192, type=int(GgmlType.I32), name="ids")
            out = T(ne=(N, used, tok, 1), buffer=ch, data=cb + 12288, op=int(GgmlOp.MUL_MAT_ID),
                    src=(w.id, bt.id, it.id), name="ffn_moe_up")
            c.set_tensor(w, wq.tobytes())
            c.set_array(bt, b)
            c.set_array(it, ids)
            c.graph_compute([out], [w, bt, it, out])
            result = np.frombuffer(c.get_tensor(out), np.float32).reshape(tok, used, N)
        return result, report.stats_dict(st.state), experts, b, ids
    raise AssertionError("unreachable")


def test_experts_on_the_npu_get_the_same_rounding(g):
    host, *_ = run_experts(None, None)
    plain, *_ = run_experts(FakeNpu(), "fp16")
    ours, stats, experts, b, ids = run_experts(FakeNpu(), "ggml")
    assert stats["activations"]["rounded_steps"] == {"q8_0": 3}        # one call per selected expert
    w16 = experts.astype(np.float16).astype(np.float32)
    rounded = ggml_rounded(g, int(GgmlType.Q8_0), b)
    want = np.stack([np.stack([w16[ids[t, s]].astype(np.float64) @ rounded[t] for s in range(ids.shape[1])])
                     for t in range(len(b))])
    np.testing.assert_allclose(ours, want, rtol=0, atol=1e-6 * np.abs(want).max())   # f32 sums, any order
    assert np.abs(ours - host).max() * 10 <= np.abs(plain - host).max()
