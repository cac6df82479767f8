"""Attention's matmuls on the (simulated) NPU with ``rknpu serve --npu-attention on`` (every f16
KV-cache pass, not only those the models price faster): llama.cpp's test-backend-ops
FLASH_ATTN_EXT and MUL_MAT cases pass against its CPU backend, and the tiny models' greedy text
through ``llama-completion --rpc`` equals the CPU-only run with flash attention on and off. The
server's counters must show attention matmuls on the NPU at M > 1, so a run that silently kept
attention on the host cannot pass."""

from __future__ import annotations

from pathlib import Path

import pytest

from support.e2e_support import RknpuServer, completion, rknpu_server, run_backend_ops, tool_or_skip
from support.gguf_models import ARCHES, write_tiny_gguf

pytestmark = [pytest.mark.llama]
ON = ("--npu-attention", "on")
PROMPT = "The capital of France is"
N_PREDICT = 12
# the cases of attention's matmuls: f16 K/V flash attention with GQA, sinks, ALiBi and softcap,
# and f16 src0 MUL_MATs that are views (permuted: not weights), with broadcast over heads
CASES = {
    "FLASH_ATTN_EXT": r"^hsk=(64|128),hsv=(64|128),nh=4,nr23=\[(1|4),1\],kv=113,nb=(1|3|32),mask=1,sinks=(0|1),"
                      r"max_bias=(0|8)\.0+,logit_softcap=(0|10)\.0+,prec=f32,type_K=f16,type_V=f16,",
    "MUL_MAT": r"^type_a=f16,type_b=f32,.*per=\[0,2,1,3\]",
}


def _attention_rows(server: RknpuServer) -> dict[int, int]:
    return {int(m): n for m, n in server.stats()["attention_npu_by_m"].items()}


def _backend_ops(tmp_path: Path, op: str, pattern: str | None, timeout: float) -> None:
    tool_or_skip("test-backend-ops")
    with rknpu_server(tmp_path, extra=ON) as server:
        result = run_backend_ops(server.endpoint, op, pattern, timeout=timeout)
        print(f"\ntest-backend-ops -b RPC0 -o {op} --npu-attention on: {result.passed}/{result.total} passed")
        context = f"{op} -p {pattern!r}\n{result.output[-4000:]}\n--- server log ---\n{server.log()}"
        assert result.total > 0 and result.passed == result.total and result.backend_ok, \
            f"{result.summary()}\n{context}"
        assert server.alive(), context
    rows = _attention_rows(server)
    assert any(m > 1 for m in rows), f"no attention matmul on the NPU at M > 1: {rows}\n{context}"


@pytest.mark.timeout(600)
@pytest.mark.parametrize("op", ["FLASH_ATTN_EXT", "MUL_MAT"])
def test_backend_ops_ci_cases_with_attention_on_npu(tmp_path: Path, op: str) -> None:
    _backend_ops(tmp_path, op, CASES[op], timeout=540)


@pytest.mark.slow
@pytest.mark.timeout(3600)
def test_backend_ops_whole_flash_attn_list_with_attention_on_npu(tmp_path: Path) -> None:
    _backend_ops(tmp_path, "FLASH_ATTN_EXT", None, timeout=3500)


@pytest.mark.timeout(900)
@pytest.mark.parametrize("fa", ["on", "off"])
@pytest.mark.parametrize("arch", ARCHES)
def test_tiny_model_greedy_text_equals_cpu(tmp_path: Path, arch: str, fa: str) -> None:
    tool_or_skip("llama-completion")
    model = write_tiny_gguf(tmp_path / f"tiny-{arch}-f16.gguf", arch, "f16")
    flags = ("-fa", fa)
    cpu_text, cpu = completion(model, PROMPT, n_predict=N_PREDICT, extra=flags)
    assert cpu.returncode == 0, cpu.stderr[-3000:]
    with rknpu_server(tmp_path, extra=("--weights", "fp16", *ON)) as server:
        text, proc = completion(model, PROMPT, n_predict=N_PREDICT, rpc=server.endpoint, extra=flags, timeout=800)
        assert proc.returncode == 0, f"{proc.stderr[-3000:]}\n--- server ---\n{server.log()}"
        assert server.alive(), server.log()
    stats = server.stats()
    rows = _attention_rows(server)
    assert any(m > 1 for m in rows) and stats["attention_host_runs"] == 0, (rows, stats["per_op"])
    op = "FLASH_ATTN_EXT" if fa == "on" else "MUL_MAT"
    assert any(r["op"] == op and r["engine"] == "npu" and r["nodes"] for r in stats["per_op"]), stats["per_op"]
    assert cpu_text.strip(), cpu.stderr[-2000:]
    assert text == cpu_text, f"RPC {text!r} != CPU {cpu_text!r}\n--- server ---\n{server.log()}"
