"""``rknpu serve`` on a simulated vendor driver whose IOMMU domains are shrunk
(``RKNPU_SIM_IOVA_BYTES``) below the model's NPU copies: the weights are NPU-resident across
several domains (the engine's ``weights_past_domain_0``), and llama.cpp's test-backend-ops
MUL_MAT and a tiny model's greedy text pass as with one domain [docs/npu-programming.md §4
"IOMMU domains"]."""

from __future__ import annotations

from pathlib import Path

import pytest

from ggml_rknpu.sim.memory import WINDOW_ENV
from support.e2e_support import completion, rknpu_server, run_backend_ops, tool_or_skip
from support.gguf_models import write_tiny_gguf

pytestmark = [pytest.mark.llama]
WINDOW = 512 << 10   # bytes per domain: less than the tiny model's fp16 NPU copies
PROMPT = "The capital of France is"
MUL_MAT_CASES = (r"^type_a=(f16|f32|q8_0|q4_0|q4_K|q5_0|q6_K),type_b=f32,m=16,n=(1|9),k=256,bs=\[(1,1|2,3)\],"
                 r"nr=\[1,1\],per=\[0,(1,2,3|2,1,3)\]")   # the CI subset of test_e2e_backend_ops.py


@pytest.mark.timeout(900)
def test_tiny_model_text_equals_cpu_across_domains(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    tool_or_skip("llama-completion")
    model = write_tiny_gguf(tmp_path / "tiny-llama-f16.gguf", "llama", "f16")
    cpu_text, cpu = completion(model, PROMPT, n_predict=12)
    assert cpu.returncode == 0, cpu.stderr[-3000:]
    monkeypatch.setenv(WINDOW_ENV, str(WINDOW))
    with rknpu_server(tmp_path, extra=("--weights", "fp16")) as server:
        text, proc = completion(model, PROMPT, n_predict=12, rpc=server.endpoint, timeout=800)
        assert proc.returncode == 0, f"{proc.stderr[-3000:]}\n--- server ---\n{server.log()}"
        assert server.alive(), server.log()
    engine = server.stats()["engine"]
    assert engine["weights_past_domain_0"] > 0, engine
    assert cpu_text.strip() and text == cpu_text, f"RPC {text!r} != CPU {cpu_text!r}\n{server.log()}"


@pytest.mark.timeout(900)
def test_backend_ops_mul_mat_across_domains(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    tool_or_skip("test-backend-ops")
    monkeypatch.setenv(WINDOW_ENV, str(64 << 10))
    with rknpu_server(tmp_path) as server:
        result = run_backend_ops(server.endpoint, "MUL_MAT", MUL_MAT_CASES, timeout=800)
        assert server.alive(), server.log()
    print(f"\nMUL_MAT with 64 KiB domains: {result.passed}/{result.total} passed; engine {server.stats()['engine']}")
    assert result.total > 0 and result.passed == result.total and result.backend_ok, \
        f"{result.summary()}\n{result.output[-4000:]}\n--- server ---\n{server.log()}"
