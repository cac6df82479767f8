"""``rknpu serve --memory-budget`` with unmodified ``llama-completion --rpc -ngl 99``: a budget
smaller than the model's NPU copies still loads the model, every weight stays host-only (the
stats name them), and the greedy text equals the CPU-only run's; a budget with room stages
them all and gives nothing up."""

from __future__ import annotations

from pathlib import Path

import pytest

from support.e2e_support import completion, rknpu_server, tool_or_skip
from support.gguf_models import write_tiny_gguf

pytestmark = [pytest.mark.llama]
PROMPT = "The capital of France is"
N_PREDICT = 12
TINY_MATMUL_WEIGHTS = 2 * 7 + 1    # 2 layers x 7 matmul weights + the output head (tests/support/gguf_models.py)


@pytest.mark.timeout(900)
def test_a_budget_below_the_npu_copies_loads_host_only_with_cpu_text(tmp_path: Path) -> None:
    tool_or_skip("llama-completion")
    model = write_tiny_gguf(tmp_path / "tiny-llama-f16.gguf", "llama", "f16")
    cpu_text, cpu = completion(model, PROMPT, n_predict=N_PREDICT)
    assert cpu.returncode == 0 and cpu_text.strip(), cpu.stderr[-3000:]
    texts, stats = {}, {}
    for name, budget in (("tight", "1"), ("room", "65536")):
        with rknpu_server(tmp_path, extra=("--weights", "fp16", "--memory-budget", budget), name=name) as server:
            text, proc = completion(model, PROMPT, n_predict=N_PREDICT, rpc=server.endpoint, timeout=800)
            assert proc.returncode == 0, f"{proc.stderr[-3000:]}\n--- server ---\n{server.log()}"
            assert server.wait_log(f"memory budget {budget} MiB of board memory (--memory-budget)"), server.log()
            texts[name], stats[name] = text, server.first_stats()
    tight, room = stats["tight"], stats["room"]
    assert tight["weights"]["uploads"] == 0 and len(tight["memory_budget"]["host_only"]) >= TINY_MATMUL_WEIGHTS
    assert "blk.0.ffn_up.weight" in tight["memory_budget"]["host_only"]
    assert tight["host_matmul_reasons"]["NPU copy over the memory budget"] >= TINY_MATMUL_WEIGHTS
    assert room["weights"]["uploads"] >= TINY_MATMUL_WEIGHTS and room["memory_budget"]["host_only"] == {}
    assert tight["board_memory"]["npu"] == 0 < room["board_memory"]["npu_retired"]   # read after the client left
    assert texts["tight"] == cpu_text, f"budgeted {texts['tight']!r} != CPU {cpu_text!r}"
    assert texts["room"] == cpu_text, f"NPU {texts['room']!r} != CPU {cpu_text!r}"
