"""Attention's matmuls on the NPU through the wire (server/attention_plan.py, attention_step.py):
both graph forms llama.cpp sends over an f16 KV cache, FLASH_ATTN_EXT and KQ = MUL_MAT(K view, Q),
SOFT_MAX, KQV = MUL_MAT(V view, KQ), give ggml-cpu's own result (a server with no engine) within
the fp16 bound; an NPU fault resets, retries and then runs the node in ggml-cpu; ``auto`` keeps
decode rows on the host; ``off`` runs none on the NPU."""

from __future__ import annotations

import struct
import tracemalloc
from types import SimpleNamespace

import numpy as np
import pytest

from ggml_rknpu.cost import npu_attention
from ggml_rknpu.engine.api import open_engine
from ggml_rknpu.hw.alignment import align_up
from ggml_rknpu.kernel.errors import NpuTimeout
from ggml_rknpu.libggml.enums import GgmlOp, GgmlType
from ggml_rknpu.server.attention_plan import AttentionPolicy
from ggml_rknpu.server.placement import NPU
from support.rpc_testkit import FakeNpu, FaultyNpu, T, serve

pytestmark = pytest.mark.timeout(120)
F16, F32 = int(GgmlType.F16), int(GgmlType.F32)
MUL_MAT, SOFT_MAX, FLASH = int(GgmlOp.MUL_MAT), int(GgmlOp.SOFT_MAX), int(GgmlOp.FLASH_ATTN_EXT)
D, H, HKV, CTX = 32, 4, 2, 64       # head dim, query heads, KV heads (2 query heads each), cache positions
# the fp16 bound: P is rounded to f16 for P.V (ggml-cpu's flash attention accumulates V in f16)
RTOL, ATOL = 2e-3, 2e-3
ALIGN = 64                          # each tensor of a test graph starts on this byte boundary


def _f(x: float) -> int:
    return struct.unpack("<i", struct.pack("<f", x))[0]


class Fp16Npu(FakeNpu):
    """The fake engine with the real one's number format: f16 weights and activations, f32 sums."""

    def upload_weight(self, b, dtype="fp16"):
        return super().upload_weight(b.astype(np.float16).astype(np.float32), dtype)

    def matmul(self, a, w, *, out=None):
        return super().matmul(a.astype(np.float16).astype(np.float32), w, out=out)


class AttentionGraph:
    """A layer's attention over a cache of ``ctx`` positions, ``rows`` new rows seeing ``n_kv``:
    K cache [D*HKV, ctx] f16, V cache transposed [ctx, D*HKV] (unfused) or as K (flash); the
    tensors laid out one after another in a new buffer, or from the base of ``buffer`` (handle, base)."""

    def __init__(self, c, rows: int, n_kv: int, flash: bool, softcap: float = 0.0, sinks: bool = False,
                 seed: int = 0, ctx: int = CTX, buffer: tuple[int, int] | None = None) -> None:
        self.c = c
        rng = np.random.default_rng(seed)
        kv = D * HKV
        sizes = (2 * kv * ctx, 2 * kv * ctx, 4 * D * rows * H, 2 * n_kv * rows, 4 * H, 4 * n_kv * rows * H,
                 4 * n_kv * rows * H, 4 * D * H * rows)
        offsets = np.cumsum((0, *(align_up(n, ALIGN) for n in sizes)))
        wh, wb = buffer or c.alloc_base(int(offsets[-1]))
        k_at, v_at, q_at, mask_at, sinks_at, kq_at, soft_at, out_at = (wb + int(o) for o in offsets[:-1])
        self.k_cache = T(ne=(kv, ctx, 1, 1), buffer=wh, data=k_at, type=F16, name="cache_k_l0")
        self.v_cache = T(ne=(kv, ctx, 1, 1), buffer=wh, data=v_at, type=F16, name="cache_v_l0")
        k = T(ne=(D, n_kv, HKV, 1), nb=(2, 2 * kv, 2 * D, 2 * kv * n_kv), buffer=wh, data=k_at, type=F16,
              view_src=self.k_cache.id, name="k-0")
        self.q = T(ne=(D, rows, H, 1), buffer=wh, data=q_at, name="q-0")
        self.mask = T(ne=(n_kv, rows, 1, 1), buffer=wh, data=mask_at, type=F16, name="kq_mask")
        mask = np.zeros((rows, n_kv), np.float32)
        for r in range(rows):                             # causal: row r sees positions <= n_kv - rows + r
            mask[r, n_kv - rows + r + 1:] = -np.inf
        self.tensors = [self.k_cache, self.v_cache, k, self.q, self.mask]
        c.set_array(self.k_cache, rng.standard_normal((ctx, kv)).astype(np.float16))
        c.set_array(self.v_cache, rng.standard_normal((ctx, kv)).astype(np.float16))
        c.set_array(self.q, rng.standard_normal((H, rows, D)).astype(np.float32))
        c.set_array(self.mask, mask.astype(np.float16))
        scale = D ** -0.5
        if flash:
            v = T(ne=(D, n_kv, HKV, 1), nb=(2, 2 * kv, 2 * D, 2 * kv * n_kv), buffer=wh,
                  data=v_at, type=F16, view_src=self.v_cache.id, name="v-0")
            src = [self.q.id, k.id, v.id, self.mask.id]
            self.tensors.append(v)
            if sinks:
                s = T(ne=(H, 1, 1, 1), buffer=wh, data=sinks_at, name="sinks")
                c.set_array(s, rng.standard_normal(H).astype(np.float32))
                src.append(s.id)
                self.tensors.append(s)
            self.out = T(ne=(D, H, rows, 1), buffer=wh, data=out_at, op=FLASH, src=tuple(src),
                         op_params=(_f(scale), _f(0.0), _f(softcap), 0), name="__fattn__-0")
            self.nodes = [self.out]
        else:
            vt = T(ne=(n_kv, D, HKV, 1), nb=(2, 2 * ctx, 2 * ctx * D, 2 * ctx * kv), buffer=wh,
                   data=v_at, type=F16, view_src=self.v_cache.id, name="v-0")
            kq = T(ne=(n_kv, rows, H, 1), buffer=wh, data=kq_at, op=MUL_MAT, src=(k.id, self.q.id),
                   name="kq-0")
            soft = T(ne=(n_kv, rows, H, 1), buffer=wh, data=soft_at, op=SOFT_MAX,
                     src=(kq.id, self.mask.id), op_params=(_f(scale), _f(0.0)), name="kq_soft_max-0")
            self.out = T(ne=(D, rows, H, 1), buffer=wh, data=out_at, op=MUL_MAT, src=(vt.id, soft.id),
                         name="kqv-0")
            self.tensors += [vt, kq, soft]
            self.nodes = [kq, soft, self.out]
        self.tensors.append(self.out)

    def compute(self) -> np.ndarray:
        self.c.graph_compute(self.nodes, self.tensors)
        return np.frombuffer(self.c.get_tensor(self.out), np.float32).copy()


def run_graph(npu, mode: str, **graph) -> tuple[np.ndarray, SimpleNamespace]:
    with serve(npu=npu, npu_attention=mode) as st:
        with st.client() as c:
            got = AttentionGraph(c, **graph).compute()
        stats = st.state.stats
        return got, SimpleNamespace(by_m=dict(stats.attention_npu_by_m), host_runs=stats.attention_host_runs,
                                    recovery=st.state.recovery, per_op=dict(stats.per_op))


FORMS = [dict(flash=False), dict(flash=True), dict(flash=True, softcap=20.0), dict(flash=True, sinks=True)]


@pytest.mark.parametrize("form", FORMS, ids=["mul_mat", "flash", "flash-softcap", "flash-sinks"])
def test_attention_on_npu_equals_ggml_cpu(form):
    rows, n_kv = 24, 48
    want, _ = run_graph(None, "off", rows=rows, n_kv=n_kv, **form)
    got, seen = run_graph(Fp16Npu(), "on", rows=rows, n_kv=n_kv, **form)
    np.testing.assert_allclose(got, want, rtol=RTOL, atol=ATOL)
    m = rows * H // HKV                                            # the query heads of a KV head as rows
    assert seen.by_m == {m: 2 * HKV}, seen.by_m                   # QK^T and PV per KV head, M > 1
    assert seen.host_runs == 0
    op = "FLASH_ATTN_EXT" if form["flash"] else "MUL_MAT"
    assert seen.per_op[(op, NPU)].ops == (1 if form["flash"] else 2)


@pytest.mark.parametrize("flash", [False, True])
def test_fault_resets_retries_then_runs_on_the_host(flash):
    want, _ = run_graph(None, "off", rows=16, n_kv=32, flash=flash)
    faults = [NpuTimeout("injected")] * 2 * (1 if flash else 2)    # each attention node faults twice
    npu = FaultyNpu(faults)
    got, seen = run_graph(npu, "on", rows=16, n_kv=32, flash=flash)
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)   # the host's own result
    r = seen.recovery
    assert r.faults["timeout"] == len(faults) and r.retries == r.host_fallbacks == len(faults) // 2
    assert npu.resets == len(faults) and seen.host_runs == len(faults) // 2
    assert npu.uploads == npu.frees                                # every staged K/V freed


def test_one_fault_then_the_retry_runs_on_the_npu():
    want, _ = run_graph(None, "off", rows=16, n_kv=32, flash=True)
    got, seen = run_graph(FaultyNpu([NpuTimeout("injected")]), "on", rows=16, n_kv=32, flash=True)
    np.testing.assert_allclose(got, want, rtol=RTOL, atol=ATOL)
    assert seen.recovery.retried_ok == 1 and seen.host_runs == 0 and sum(seen.by_m.values()) == 2 * HKV


@pytest.mark.parametrize("flash", [False, True])
def test_off_and_decode_rows_stay_on_the_host(flash):
    for mode, rows in (("off", 24), ("auto", 1)):
        npu = FakeNpu()
        _, seen = run_graph(npu, mode, rows=rows, n_kv=48, flash=flash)
        assert npu.uploads == 0 and seen.by_m == {}, (mode, rows)


def test_auto_prices_prefill_on_the_npu_and_decode_on_the_host():
    policy = AttentionPolicy("auto", cores=3, threads=4)
    for heads, kv_heads, head_dim in ((4, 1, 256), (16, 8, 128)):   # gemma3-270m, qwen3-1.7b
        assert not policy.flash_wins(1, 4096, heads, kv_heads, head_dim)
        assert policy.flash_wins(512, 2048, heads, kv_heads, head_dim)
    assert not policy.matmul_wins(4, 256, 4096) and policy.matmul_wins(2048, 256, 2048)
    with pytest.raises(ValueError, match="npu-attention"):
        AttentionPolicy("always")


@pytest.mark.parametrize("flash", [False, True])
def test_simulated_engine_within_the_fp16_bound(flash):
    """The engine itself (simulated NPU): the staged cache and the stacked rows through its
    packing, programs and submits give ggml-cpu's result within the fp16 bound."""
    want, _ = run_graph(None, "off", rows=40, n_kv=56, flash=flash)
    with open_engine("sim-rknpu") as npu:
        got, seen = run_graph(npu, "on", rows=40, n_kv=56, flash=flash)
        assert npu.counters["weights_freed"] == npu.counters["weights_uploaded"] == 2 * HKV
    np.testing.assert_allclose(got, want, rtol=RTOL, atol=ATOL)
    assert seen.by_m == {40 * H // HKV: 2 * HKV} and seen.host_runs == 0


def test_cached_flash_plans_hold_no_scores():
    """A split FLASH_ATTN_EXT's scores (heads x rows x n_kv f32) exist only while it runs: plans
    of distinct graphs stay cached (each replays from the cache afterwards), and the numpy
    memory they hold (tracemalloc traces numpy's data) stays below one plan's scores."""
    rows, ctx, n_plans = 256, 1024, 6
    scores = 4 * H * rows * ctx                                    # 4 MiB a plan
    tracemalloc.start()
    try:
        with serve(npu=Fp16Npu(), npu_attention="on") as st:
            with st.client() as c:
                buffer = c.alloc_base(1 << 24)
                graphs = [AttentionGraph(c, rows=rows, n_kv=ctx - i, flash=True, ctx=ctx, buffer=buffer)
                          for i in range(n_plans + 1)]
                graphs[0].compute()                                # the server's first plan: lazy set-up
                before = tracemalloc.get_traced_memory()[0]
                for g in graphs[1:]:
                    g.compute()
                held = tracemalloc.get_traced_memory()[0] - before
                for g in graphs:
                    g.compute()
            assert st.state.stats.plan_cache_hits == n_plans + 1   # every plan was still cached
            assert st.state.stats.attention_host_runs == 0
    finally:
        tracemalloc.stop()
    assert held < scores, f"{n_plans} cached plans hold {held} bytes; one plan's scores are {scores}"


@pytest.mark.parametrize("form", FORMS[1:], ids=["flash", "flash-softcap", "flash-sinks"])
def test_flash_rows_in_blocks_give_the_same_bits(form, monkeypatch):
    """Scores beyond the block bound run a block of rows at a time (the last one shorter),
    each block's mask rows its own, each KV head's K and V staged once for all blocks: one
    block's bits with the fake engine (rows are independent
    in numpy's f32 matmul and in ggml's softmax), its f32 rounding with the simulated one
    (whose host BLAS sums in an order that depends on M)."""
    rows, n_kv = 40, 48
    whole = {}
    for name, make in (("fake", Fp16Npu), ("sim", lambda: open_engine("sim-rknpu"))):
        npu = make()
        whole[name], seen = run_graph(npu, "on", rows=rows, n_kv=n_kv, **form)
        assert seen.by_m == {rows * H // HKV: 2 * HKV}
        monkeypatch.setattr(npu_attention, "SCORES_BLOCK_BYTES", 4 * H * n_kv * 16)     # 16 rows a block
        blocked = make()
        got, seen = run_graph(blocked, "on", rows=rows, n_kv=n_kv, **form)
        monkeypatch.undo()
        staged = ((blocked.uploads, blocked.frees) if isinstance(blocked, FakeNpu)
                  else (blocked.counters["weights_uploaded"], blocked.counters["weights_freed"]))
        assert staged == (2 * HKV, 2 * HKV)                        # K and V staged once for every block
        npu.close()
        blocked.close()
        np.testing.assert_allclose(got, whole[name], rtol=0 if name == "fake" else 1e-6, atol=0 if name == "fake" else 1e-6)
        assert seen.by_m == {16 * H // HKV: 2 * 2 * HKV, 8 * H // HKV: 2 * HKV} and seen.host_runs == 0


def test_a_long_span_runs_in_bounded_scratch(monkeypatch):
    """While a split FLASH_ATTN_EXT runs, its scratch stays near one block's scores, not the
    whole node's (tracemalloc's peak over the run, numpy's data traced)."""
    rows, ctx = 256, 1024
    scores = 4 * H * rows * ctx                                    # 4 MiB for the node
    monkeypatch.setattr(npu_attention, "SCORES_BLOCK_BYTES", scores // 8)
    tracemalloc.start()
    try:
        with serve(npu=Fp16Npu(), npu_attention="on") as st:
            with st.client() as c:
                graph = AttentionGraph(c, rows=rows, n_kv=ctx, flash=True, ctx=ctx)
                c.device_count()                                   # the uploads are in
                base = tracemalloc.get_traced_memory()[0]
                tracemalloc.reset_peak()
                graph.compute()
                peak = tracemalloc.get_traced_memory()[1] - base
            assert st.state.stats.attention_npu_by_m == {rows // 8 * H // HKV: 8 * 2 * HKV}
    finally:
        tracemalloc.stop()
    assert peak < scores // 2, f"{peak} bytes at the peak of a run whose whole scores are {scores}"
