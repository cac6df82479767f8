"""Long-K tiling (K > 8192): K chunk invariants, and the *modeled* gain on the prefill
shape that motivated it (``docs/engine.md``: 512x8960x1536 fp16 modeled at ~140 GFLOP/s
when one 8960-channel chunk's kernel group took 9 of the 12 CBUF banks)."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from ggml_rknpu.compiler.matmul import compile_matmul
from ggml_rknpu.compiler.tiling import MAX_TASK_K, MIN_CHUNK_K, SDK_SPLIT_K, k_chunks
from ggml_rknpu.cost.model import modeled_time, vendor_style_workload
from ggml_rknpu.hw import limits
from ggml_rknpu.hw.alignment import align_up, ceil_div


@settings(max_examples=80, deadline=None)
@given(st.integers(1, 60000), st.sampled_from(["fp16", "int8"]))
def test_k_chunks_partition_k_within_the_bank_rules(K, dtype):
    chunks = k_chunks(K, dtype, "extended")
    Kp = align_up(K, 32)
    assert [c.index for c in chunks] == list(range(len(chunks)))
    k0 = 0
    for c in chunks:
        assert c.k0 == k0 and c.size % 32 == 0 and 0 < c.size <= MAX_TASK_K
        assert c.size * limits.BYTES[dtype] <= limits.CBUF_BANK_BYTES          # a kernel fits a bank [§9]
        group = limits.KERNEL_GROUP[dtype] * c.size * limits.BYTES[dtype]
        assert group <= (limits.CBUF_BANKS - 1) * limits.CBUF_BANK_BYTES      # a group leaves a data bank
        k0 += c.size
    assert k0 == Kp
    if Kp <= SDK_SPLIT_K:
        assert len(chunks) == 1                                  # MTX/SDK single-task K
    else:
        assert 2 <= len(chunks) <= max(ceil_div(Kp, MAX_TASK_K), ceil_div(Kp, MIN_CHUNK_K))
    assert all(c.size == chunks[0].size for c in chunks[:-1]) and chunks[-1].size <= chunks[0].size


def _gflops(M, K, N, dtype="fp16", out="fp32"):
    prog = compile_matmul(M, K, N, dtype=dtype, out=out, cores=3, envelope="extended")
    return modeled_time(prog).gflops(2 * M * K * N)


def test_issue_prefill_shape_models_faster():
    # modeled, 3 cores, 1 GHz, DRAM 2112 MHz. Before (one 8960-channel chunk, 5 rows per
    # task, 309 tasks): 140.4 GFLOP/s; vendor-style tiling of the same shape: 907.5.
    ours = _gflops(512, 8960, 1536)
    vendor = modeled_time(vendor_style_workload(512, 8960, 1536, cores=3)).gflops(2 * 512 * 8960 * 1536)
    assert ours >= 1500 and ours > vendor
    # 512x11008x4096 fp16 before (two 5504-channel chunks): 443.3 GFLOP/s modeled
    assert _gflops(512, 11008, 4096) >= 1500
    # int8 512x8960x1536 before: 547.2 GOP/s modeled
    assert _gflops(512, 8960, 1536, "int8", "int32") >= 2500


def test_decode_of_long_k_loses_little():
    # M=1 is weight-stream bound; more chunks add tasks and partial C but the same weights.
    # Before: 26.3 (1x8960x1536) and 27.6 (1x11008x4096) GFLOP/s modeled.
    assert _gflops(1, 8960, 1536) >= 0.97 * 26.3
    assert _gflops(1, 11008, 4096) >= 0.97 * 27.6
