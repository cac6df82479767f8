"""The differential check over architectures: every tiny model of tests/support/arch_models.py
that the pinned C++ ``ggml-rpc-server`` computes, ``rknpu serve`` computes too, with the
CPU-only result.

Per architecture: the C++ server gives the CPU-only result (the precondition: a graph it
computes); ``rknpu serve --device host`` gives it exactly (the same ggml-cpu kernels); the
simulated NPU (fp16 weights) agrees up to the near-tie rule of tests/support/greedy.py
(generation: llama-server's top-2 logprobs per token; t5 through llama-completion, which has
no logprobs, so its text must be equal). Embedding and reranking models: the vectors (the
pooled embedding; the scores of a few documents) equal the CPU's on the host and have cosine
>= 0.9999 with them on the NPU. The server's per-op counters must show each architecture's
own ops run there, so a run that stayed on the CPU cannot pass. The servers are shared by the
module (one start each); the counters are compared before and after each case.

Every case is a second or two (65 cases in 50 s on this shared 2-core box), so all of them
run in CI.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from support.arch_models import ARCHITECTURES, BY_NAME, write_arch_gguf
from support.e2e_support import RknpuServer, Server, completion, cpp_server, llama_server, rknpu_server, tool_or_skip
from support.greedy import agree, choices

pytestmark = [pytest.mark.llama, pytest.mark.timeout(600)]
PROMPT = "The capital of France is"
N_PREDICT = 8
COSINE = 0.9999
DOCUMENTS = ["Paris is the capital of France.", "the city of the cat", "it was on the way"]
NO_WARMUP = ("--no-warmup",)

CASES = [a.name for a in ARCHITECTURES]


@pytest.fixture(scope="module")
def servers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Server]]:
    """The three devices: llama.cpp's C++ server, ours on the host, ours on the simulated NPU."""
    for tool in ("ggml-rpc-server", "llama-server", "llama-completion"):
        tool_or_skip(tool)
    root = tmp_path_factory.mktemp("servers")
    with cpp_server(root) as cpp, rknpu_server(root, device="host", name="host") as host, \
            rknpu_server(root, extra=("--weights", "fp16"), name="npu") as npu:
        yield {"cpp": cpp, "host": host, "npu": npu}


def _per_op(server: RknpuServer) -> dict[str, int]:
    if not server.stats_path.is_file():
        return {}
    out: dict[str, int] = {}
    for row in server.stats()["per_op"]:
        out[row["op"]] = out.get(row["op"], 0) + row["nodes"]
    return out


def _ran(server: RknpuServer, before: dict[str, int], ops: tuple[str, ...]) -> None:
    """The architecture's own ops ran on ``server`` since ``before`` (the counters are written
    when a client's session ends, shortly after the client exits)."""
    deadline = time.monotonic() + 30
    while True:
        after = _per_op(server)
        missing = [op for op in ops if after.get(op, 0) <= before.get(op, 0)]
        if not missing:
            return
        assert time.monotonic() < deadline, (missing, after, server.log())
        time.sleep(0.2)


def _text(model: Path, server: Server | None, what: str) -> str:
    text, proc = completion(model, PROMPT, n_predict=N_PREDICT, rpc=server.endpoint if server else None,
                            extra=NO_WARMUP, timeout=300)
    log = server.log() if server else ""
    assert proc.returncode == 0, f"{what}: {proc.stderr[-3000:]}\n--- server ---\n{log}"
    return text


def _answer(tmp_path: Path, model: Path, server: Server | None):
    """llama-server's greedy answer with top-2 logprobs per token (tests/support/greedy.py)."""
    with llama_server(tmp_path, model, rpc=server.endpoint if server else None, extra=NO_WARMUP) as ls:
        reply = ls.post("/completion", {"prompt": PROMPT, "temperature": 0.0, "n_predict": N_PREDICT, "seed": 1,
                                        "ignore_eos": True, "n_probs": 2, "cache_prompt": False})
    return choices(reply["completion_probabilities"])


def _vectors(tmp_path: Path, model: Path, kind: str, server: Server | None) -> np.ndarray:
    """The pooled embedding of PROMPT, or the reranking scores of DOCUMENTS for PROMPT."""
    flag = "--embeddings" if kind == "embed" else "--reranking"
    with llama_server(tmp_path, model, rpc=server.endpoint if server else None, extra=(flag, *NO_WARMUP)) as ls:
        if kind == "embed":
            reply = ls.post("/embedding", {"content": PROMPT})
            return np.asarray(reply[0]["embedding"], dtype=np.float64).ravel()
        reply = ls.post("/rerank", {"query": PROMPT, "documents": DOCUMENTS})
    return np.asarray([r["relevance_score"] for r in sorted(reply["results"], key=lambda r: r["index"])])


def _cosine(a: np.ndarray, b: np.ndarray) -> float:
    return float(a @ b / (np.linalg.norm(a) * np.linalg.norm(b)))


@pytest.mark.parametrize("name", CASES)
def test_rknpu_serve_computes_what_the_cpp_server_computes(tmp_path: Path, servers: dict[str, Server],
                                                           name: str) -> None:
    arch = BY_NAME[name]
    model = write_arch_gguf(tmp_path / f"tiny-{name}.gguf", name)
    host, npu = servers["host"], servers["npu"]
    assert isinstance(host, RknpuServer) and isinstance(npu, RknpuServer)
    before = {"host": _per_op(host), "npu": _per_op(npu)}
    if arch.kind in ("text", "encdec"):
        cpu = _text(model, None, "CPU")
        assert cpu.strip(), "the CPU-only run generated no text to compare"
        assert _text(model, servers["cpp"], "ggml-rpc-server") == cpu, "the C++ server differs: not a valid case"
        assert _text(model, host, "--device host") == cpu
        if arch.kind == "encdec":                         # llama-server has no encoder-decoder path
            assert _text(model, npu, "NPU") == cpu
        else:
            agree(_answer(tmp_path, model, npu), _answer(tmp_path, model, None), what=f"{name} on the NPU")
    else:
        cpu_v = _vectors(tmp_path, model, arch.kind, None)
        assert cpu_v.size and np.isfinite(cpu_v).all(), cpu_v
        assert _cosine(_vectors(tmp_path, model, arch.kind, servers["cpp"]), cpu_v) >= COSINE, \
            "the C++ server differs: not a valid case"
        np.testing.assert_array_equal(_vectors(tmp_path, model, arch.kind, host), cpu_v)   # the same kernels
        npu_v = _vectors(tmp_path, model, arch.kind, npu)
        assert _cosine(npu_v, cpu_v) >= COSINE, (npu_v, cpu_v)
    assert host.alive() and npu.alive()
    _ran(host, before["host"], arch.ops)
    _ran(npu, before["npu"], arch.ops)
