"""llama.cpp's own ``test-backend-ops -b RPC0`` against ``rknpu serve`` on the simulated NPU.

test-backend-ops has no --rpc option, so the device comes in through our GGML_BACKEND_PATH
plugin (tools/rpc_env_plugin.c, ggml-rpc.md §4). Each case builds a small graph, runs it on RPC0
and on the CPU backend, and compares every node (NMSE): a passing op here is a correct op for
llama.cpp, judged by llama.cpp.

CI runs a subset per op (``CI_CASES``: regexes over the case parameters, chosen to cover every
type and mode the models of ggml-rpc.md §5.2 send, within the CI time budget); the full lists
run under ``-m slow`` and in ``scripts/test-backend-ops-full``.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from ggml_rknpu.toolchain.llamacpp import CLIENTS, PINNED
from support.e2e_support import Server, cpp_server, parse_backend_ops, rknpu_server, run_backend_ops, tool_or_skip
from support.proc_status import status_bytes

pytestmark = [pytest.mark.llama]

# op -> -p filter for the full pytest run (None: every case of the op). The whole suite, every op
# of --list-ops with a fresh server each, is tests/e2e/backend_ops_table.py (scripts/test-backend-ops-full).
FULL_OPS: dict[str, str | None] = {
    "MUL_MAT": None, "MUL_MAT_ID": None,
    "ADD": None, "MUL": None, "SCALE": None, "RMS_NORM": None, "NORM": None,
    "GET_ROWS": None, "SET_ROWS": None, "CPY": None,
    "CONT": None, "DUP": None, "ROPE": None, "SOFT_MAX": None,
    "FLASH_ATTN_EXT": None, "ARGSORT": None, "TOP_K": None, "SSM_CONV": None, "SSM_SCAN": None,
    "GATED_DELTA_NET": None,
    "SWIGLU": None, "GEGLU": None, "REGLU": None, "SILU": None, "GELU": None,
    # vision towers, backward pass / optimizer, DeepSeek-V4 (ops/rules_conv.py, rules_training.py, rules_dsv4.py)
    "CONV_2D": None, "CONV_2D_DW": None, "CONV_TRANSPOSE_1D": None, "IM2COL_3D": None, "POOL_1D": None,
    "POOL_2D": None, "UPSCALE": None, "PAD_REFLECT_1D": None, "ACC": None, "SET": None, "OUT_PROD": None,
    "GET_ROWS_BACK": None, "ROPE_BACK": None, "CROSS_ENTROPY_LOSS_BACK": None, "OPT_STEP_ADAMW": None,
    "LIGHTNING_INDEXER": None, "DSV4_HC_POST": None,
}

# op -> -p filter for CI. Ops whose full list runs in seconds run it whole; the long lists
# (FLASH_ATTN_EXT ~6 min, ROPE, GET_ROWS, MUL_MAT, MUL_MAT_ID, ADD, CONT ~0.5-2 min each on this box) run
# the types and modes the llama, qwen2, qwen3 and gemma3 graphs use (ggml-rpc.md §5.2): weight
# types of the models, the non-weight f16/f32 KQ/KQV shapes (broadcast, permuted), NORMAL and
# NEOX rope with and without YaRN and freq factors, f16 KV flash attention with GQA and softcap;
# MoE expert matmuls (MUL_MAT_ID), and writes into K-quant and IQ KV caches (CPY, SET_ROWS).
_CHEAP_FULL = ("MUL", "SCALE", "RMS_NORM", "NORM", "DUP", "SOFT_MAX", "ARGSORT", "TOP_K", "SSM_CONV",
               "SSM_SCAN", "GATED_DELTA_NET", "SWIGLU", "GEGLU", "REGLU", "SILU", "GELU",
               "CONV_2D_DW", "CONV_TRANSPOSE_1D", "POOL_1D", "POOL_2D", "UPSCALE", "PAD_REFLECT_1D", "ACC", "SET",
               "GET_ROWS_BACK", "CROSS_ENTROPY_LOSS_BACK", "OPT_STEP_ADAMW", "DSV4_HC_POST")
CI_CASES: dict[str, str | None] = {
    "MUL_MAT": r"^type_a=(f16|f32|q8_0|q4_0|q4_K|q5_0|q6_K),type_b=f32,m=16,n=(1|9),k=256,bs=\[(1,1|2,3)\],"
               r"nr=\[1,1\],per=\[0,(1,2,3|2,1,3)\]",
    "MUL_MAT_ID": r"^type_a=(f16|q4_0|q4_K|iq4_nl),type_b=f32,n_mats=(4|8),n_used=(1|2|4),b=(0|1),m=512,n=(1|32),k=256",
    "ADD": r"^type=f32,ne=\[(10|16),",
    "CONT": r"^type=(f32|f16),ne=\[10,10,10,1\]",
    "GET_ROWS": r"^type=(f32|f16|q8_0|q4_K|q6_K),n=256,m=5,r=4,be1=1,be2=1,v=0",
    "ROPE": r"^type=f32,ne_a=\[(128,32|64,8),2,1\],n_dims=(128|64),mode=(0|2),n_ctx=512,fs=1\.0+,ef=(0\.0+|0\.7465)",
    "FLASH_ATTN_EXT": r"^hsk=(64|128),hsv=(64|128),nh=4,nr23=\[(1|4),1\],kv=113,nb=(1|3),mask=1,sinks=0,"
                      r"max_bias=0\.0+,logit_softcap=(0|10)\.0+,prec=f32,type_K=f16,type_V=f16,permute=\[0,1,2,3\]"
                      r"|type_K=q8_0,type_V=q4_0,",   # a mixed K/V cache (-ctk q8_0 -ctv q4_0)
    "CPY": r"^type_src=f32,type_dst=(f16|q8_0|q4_K|q6_K|iq4_nl|iq4_xs|mxfp4),",
    "SET_ROWS": r"^type_src=f32,type_dst=(f16|q8_0|q4_K|q5_K|iq4_nl|iq4_xs),",
    # the long lists of the newer rules (CONV_2D 2030 cases, IM2COL_3D 2051, LIGHTNING_INDEXER 156, ROPE_BACK
    # 404, OUT_PROD 231): f16 and f32 kernels with stride/padding/dilation and a kernel view, a CWHN
    # (permuted) input; both im2col_3d dst types; f16 and q4_0 keys; ROPE's CI modes run backwards;
    # f32 (broadcast), f16 and q8_0 src0 products
    "CONV_2D": r"^ne_input=\[19,17,|^ne_input=\[1,1,1,2\],ne_kernel=\[1,1,1,1\],type_kernel=f(16|32),stride0=1,"
               r"stride1=5,padding0=5,padding1=2,dilation0=2,dilation1=4,cwhn=1",
    "IM2COL_3D": r"^type_input=f32,type_kernel=f16,dst_type=f(16|32),ne_input=\[10,10,10,9\]",
    "LIGHTNING_INDEXER": r"nb=1,.*type_K=(f16|q4_0)",
    "ROPE_BACK": r"^type=f32,ne_a=\[(128,32|64,8),2,1\],n_dims=(128|64),mode=(0|2),n_ctx=512,fs=1\.0+,ef=(0\.0+|0\.7465)",
    "OUT_PROD": r"^type_a=(f32|f16|q8_0),type_b=f32,m=256,n=16,k=(1|16),",
    **{op: FULL_OPS[op] for op in _CHEAP_FULL},
}


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory):
    tool_or_skip("test-backend-ops")
    with rknpu_server(tmp_path_factory.mktemp("backend-ops")) as srv:
        yield srv


def _check(server: Server, op: str, pattern: str | None, timeout: float, client: str = PINNED) -> None:
    result = run_backend_ops(server.endpoint, op, pattern, timeout=timeout, client=client)
    print(f"\n{client} test-backend-ops -b RPC0 -o {op}: {result.passed}/{result.total} passed")
    context = f"{op} -p {pattern!r}\n{result.output[-4000:]}\n--- server log ---\n{server.log()}"
    assert result.total > 0 and result.passed == result.total and result.backend_ok, \
        f"{result.summary()}\n{context}"
    assert server.alive(), f"server died: {context}"


@pytest.mark.timeout(600)
@pytest.mark.parametrize("op", sorted(CI_CASES))
def test_backend_ops_ci_subset(server: Server, op: str) -> None:
    _check(server, op, CI_CASES[op], timeout=540)


# Every other client build (scripts/build-llama-cpp --list) runs the ops that gemma3 and the tiny
# models send, in the CI subset's cases: enough to show the client's graphs and ours agree.
OTHER_CLIENT_OPS = ("MUL_MAT", "GET_ROWS", "SET_ROWS", "ROPE", "FLASH_ATTN_EXT", "RMS_NORM", "GEGLU")


@pytest.mark.timeout(600)
@pytest.mark.parametrize("op", OTHER_CLIENT_OPS)
@pytest.mark.parametrize("client", [c for c in CLIENTS if c != PINNED])
def test_backend_ops_subset_other_clients(server: Server, client: str, op: str) -> None:
    tool_or_skip("test-backend-ops", client)
    _check(server, op, CI_CASES[op], timeout=540, client=client)


@pytest.mark.slow
@pytest.mark.timeout(3600)
@pytest.mark.parametrize("op", sorted(FULL_OPS))
def test_backend_ops_full(server: Server, op: str) -> None:
    _check(server, op, FULL_OPS[op], timeout=3500)


PEAK_RSS_BYTES = 3 * 10**9   # the server's whole-table bound (docs/memory.md)


@pytest.mark.slow
@pytest.mark.timeout(3600)
def test_mul_mat_id_list_peak_rss(tmp_path: Path) -> None:
    """The whole MUL_MAT_ID list (its 128-expert q4_K cases are the table's largest) on a
    fresh server, whose VmHWM stays within the bound: 2629 MiB measured on x86."""
    tool_or_skip("test-backend-ops")
    with rknpu_server(tmp_path, name="serve-moe-peak") as srv:
        assert srv.proc is not None
        _check(srv, "MUL_MAT_ID", None, timeout=3500)
        peak = status_bytes("VmHWM", srv.proc.pid)
    assert peak is not None and peak <= PEAK_RSS_BYTES, f"server VmHWM {peak} bytes"


@pytest.mark.timeout(1200)
@pytest.mark.parametrize("placement", ["auto", "host", "auto --placement-split", "npu --memory-budget 1"])
def test_matmul_lists_pass_with_each_placement(tmp_path: Path, placement: str) -> None:
    """MUL_MAT and MUL_MAT_ID (the CI cases) with the weight matmuls placed by cost, all in
    ggml-cpu (repacked copies where ggml repacks), split where the models say so, or every
    weight and expert host only for a memory budget below the board bytes (--placement npu
    without a budget is the module's server above)."""
    tool_or_skip("test-backend-ops")
    with rknpu_server(tmp_path, extra=("--placement", *placement.split())) as srv:
        for op in ("MUL_MAT", "MUL_MAT_ID"):
            _check(srv, op, CI_CASES[op], timeout=540)


def test_filters_are_valid_regexes() -> None:
    import re
    for pattern in [p for p in (*CI_CASES.values(), *FULL_OPS.values()) if p]:
        re.compile(pattern)
    assert set(CI_CASES) == set(FULL_OPS) and set(OTHER_CLIENT_OPS) <= set(CI_CASES)


@pytest.mark.timeout(300)
def test_harness_against_cpp_rpc_server(tmp_path: Path) -> None:
    """The plugin, filters and parsing work: llama.cpp's own CPU rpc-server passes the CI subset
    of two ops, so a failure in the tests above is the server's, not the harness's."""
    tool_or_skip("test-backend-ops")
    with cpp_server(tmp_path) as reference:
        for op in ("FLASH_ATTN_EXT", "MUL_MAT"):
            result = run_backend_ops(reference.endpoint, op, CI_CASES[op], timeout=240)
            assert result.total > 0 and result.passed == result.total and result.backend_ok, \
                f"{result.summary()}\n{result.output[-3000:]}"


def test_parse_backend_ops_counts_and_failures() -> None:
    out = ("  ADD(type=f32): \x1b[1;32mOK\x1b[0m\n  ADD(type=f16): [ADD] NMSE = 1.0 > 1e-07 \x1b[1;31mFAIL\x1b[0m\n"
           "  1/2 tests passed\n  Backend RPC0[127.0.0.1:5]: \x1b[1;31mFAIL\x1b[0m\n")
    result = parse_backend_ops(out)
    assert (result.passed, result.total, result.backend_ok) == (1, 2, False)
    assert result.failures == ("ADD(type=f16): [ADD] NMSE = 1.0 > 1e-07 FAIL",)
    ok = parse_backend_ops("  3/3 tests passed\n  Backend RPC0[h:1]: OK\n")
    assert (ok.passed, ok.total, ok.backend_ok) == (3, 3, True)


@pytest.mark.timeout(300)
def test_unsupported_op_leaves_server_serving(server: Server) -> None:
    """A node no validator rule admits yet (test-backend-ops' MUL_MAT_HADAMARD cases: a MUL_MAT with
    the GGML_HINT_SRC0_IS_HADAMARD hint): the server logs its signature and closes that client's
    connection (the client aborts, as ggml RPC has no error reply), and the next client is served."""
    refused = run_backend_ops(server.endpoint, "MUL_MAT_HADAMARD", None, timeout=240)
    assert refused.total == 0 and refused.returncode != 0, refused.output[-2000:]
    assert "unsupported op MUL_MAT(f32,f32)->f32: mul_mat hints are not admitted" in server.log(), server.log()
    assert server.alive()
    after = run_backend_ops(server.endpoint, "SCALE", FULL_OPS["SCALE"], timeout=240)
    assert after.total > 0 and after.passed == after.total, after.summary()
