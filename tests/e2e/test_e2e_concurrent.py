"""Real llama.cpp clients served at once by one ``rknpu serve`` (simulated NPU): while
``llama-server`` holds its connection, two ``llama-completion`` processes run to completion
next to it, each giving the tokens it gives alone, and they share the server's staged weights
(same GGUF, same bytes) instead of uploading their own."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from support.e2e_support import completion, llama_server, rknpu_server, tool_or_skip
from support.gguf_models import write_tiny_gguf

pytestmark = [pytest.mark.llama]
PROMPTS = ("The capital of France is", "Once upon a time")
N_PREDICT = 12


@pytest.mark.timeout(900)
def test_two_completions_beside_a_connected_llama_server_give_their_tokens_alone(tmp_path: Path) -> None:
    tool_or_skip("llama-completion")
    tool_or_skip("llama-server")
    model = write_tiny_gguf(tmp_path / "tiny-llama-f16.gguf", "llama", "f16")
    with rknpu_server(tmp_path, extra=("--weights", "fp16"), name="alone") as server:
        alone = []
        for prompt in PROMPTS:
            text, proc = completion(model, prompt, n_predict=N_PREDICT, rpc=server.endpoint, timeout=800)
            assert proc.returncode == 0, f"{proc.stderr[-3000:]}\n--- server ---\n{server.log()}"
            alone.append(text)
    assert all(t.strip() for t in alone), alone

    with rknpu_server(tmp_path, extra=("--weights", "fp16"), name="together") as server:
        with llama_server(tmp_path, model, rpc=server.endpoint) as chat:   # connected from here on
            body = {"prompt": PROMPTS[0], "n_predict": N_PREDICT, "temperature": 0, "seed": 1}
            before = chat.post("/completion", body)["content"]
            with ThreadPoolExecutor(2) as pool:
                runs = list(pool.map(lambda p: completion(model, p, n_predict=N_PREDICT, rpc=server.endpoint,
                                                          timeout=800), PROMPTS))
            for (text, proc), want in zip(runs, alone, strict=True):
                assert proc.returncode == 0, f"{proc.stderr[-3000:]}\n--- server ---\n{server.log()}"
                assert text == want, f"together {text!r} != alone {want!r}"
            assert chat.post("/completion", body)["content"] == before   # llama-server still served, same answer
        assert server.alive(), server.log()
        stats = server.stats()
    sessions, shared = stats["sessions"], stats["shared_weights"]
    assert sessions["peak"] >= 2 and sessions["refused_at_accept"] == 0, sessions
    assert shared["shared"] > 0, shared     # a completion used llama-server's staged copies
