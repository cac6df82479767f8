"""The multimodal projector through ``rknpu serve``: llama-server with ``--mmproj`` and ``--rpc``
places the vision encoder (mtmd's clip) on the RPC device (docs/llama-cpp.md, "The multimodal
projector"), so an image prompt sends the projector's graph to our server as well as the text
model's.

The check, per projector type of tests/support/mmproj_models.py (LLaVA's MLP with a tiny llama,
gemma3's with a tiny gemma3, Qwen2-VL's merger with a tiny qwen2vl): two different images, a greedy answer with top-2 logprobs for
each. The C++ ``ggml-rpc-server`` gives the CPU-only tokens (the precondition: a graph it
computes); ``rknpu serve --device host`` gives them exactly, logprobs to the bit (the same
ggml-cpu kernels); the simulated NPU (fp16 weights) agrees up to the near-tie rule of
tests/support/greedy.py. The two images' answers differ on the CPU by more than that rule lets
a device differ, so a projector that computed wrong embeddings could not pass. The encoder's own
ops (``Projector.ops``: the patch convolution's IM2COL and others no text graph has) must show
in the server's counters, and the NPU must have run matmuls of the ViT's row count.
"""

from __future__ import annotations

import base64
import json
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from support.arch_models import N_EMBD
from support.e2e_support import RknpuServer, Server, cpp_server, llama_server, rknpu_server, tool_or_skip
from support.greedy import CLOSE, Choice, agree, choices
from support.mmproj_models import PROJECTORS, tiny_bmp, write_mmproj_gguf, write_text_gguf

pytestmark = [pytest.mark.llama, pytest.mark.timeout(600)]
PROMPT = "{marker} is"      # the image right before the answer: its embeddings steer it most
N_PREDICT = 8
IMAGE_SEEDS = (0, 1)


@pytest.fixture(scope="module")
def servers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Server]]:
    for tool in ("ggml-rpc-server", "llama-server"):
        tool_or_skip(tool)
    root = tmp_path_factory.mktemp("servers")
    with cpp_server(root) as cpp, rknpu_server(root, device="host", name="host") as host, \
            rknpu_server(root, extra=("--weights", "fp16"), name="npu") as npu:
        yield {"cpp": cpp, "host": host, "npu": npu}


def _answers(tmp_path: Path, models: tuple[Path, Path], server: Server | None) -> list[list[Choice]]:
    """llama-server's greedy answer for each image (CPU-only, or offloaded to ``server``)."""
    text, mmproj = models
    ls = llama_server(tmp_path, text, rpc=server.endpoint if server else None,
                      extra=("--mmproj", str(mmproj), "--no-warmup"))
    with ls:
        with urllib.request.urlopen(f"http://{ls.endpoint}/props", timeout=30) as props:
            marker = json.loads(props.read())["media_marker"]   # random per process unless LLAMA_MEDIA_MARKER
        out = []
        for seed in IMAGE_SEEDS:
            image = base64.b64encode(tiny_bmp(seed=seed)).decode()
            reply = ls.post("/completion", {
                "prompt": {"prompt_string": PROMPT.format(marker=marker), "multimodal_data": [image]},
                "temperature": 0.0, "n_predict": N_PREDICT, "seed": 1, "ignore_eos": True, "n_probs": 2,
                "cache_prompt": False})
            out.append(choices(reply["completion_probabilities"]))
    return out


def _tokens(answers: list[list[Choice]]) -> list[list[int]]:
    return [[s.token for s in a] for a in answers]


def _per_op(server: RknpuServer) -> dict[str, int]:
    if not server.stats_path.is_file():
        return {}
    out: dict[str, int] = {}
    for row in server.stats()["per_op"]:
        out[row["op"]] = out.get(row["op"], 0) + row["nodes"]
    return out


def _npu_rows(server: RknpuServer, rows: int) -> int:
    """Matmuls the NPU ran with ``rows`` rows so far."""
    return server.stats()["npu_matmuls_by_m"].get(str(rows), 0) if server.stats_path.is_file() else 0


def _ran(server: RknpuServer, before: dict[str, int], ops: tuple[str, ...]) -> None:
    """The encoder's ``ops`` ran on ``server`` since ``before`` (counters are written when a
    client's session ends, shortly after llama-server exits)."""
    deadline = time.monotonic() + 30
    while True:
        after = _per_op(server)
        missing = [op for op in ops if after.get(op, 0) <= before.get(op, 0)]
        if not missing:
            return
        assert time.monotonic() < deadline, (missing, after, server.log())
        time.sleep(0.2)


def _differ(a: list[Choice], b: list[Choice]) -> bool:
    """Two answers differ by more than the near-tie rule lets a device's answer differ: another
    token, or the same token more than ``CLOSE`` apart in logprob."""
    return any(x.token != y.token or abs(x.logprob - y.logprob) > CLOSE for x, y in zip(a, b))


@pytest.mark.parametrize("projector", sorted(PROJECTORS))
def test_the_projector_runs_on_rknpu_serve_with_the_cpu_tokens(tmp_path: Path, servers: dict[str, Server],
                                                               projector: str) -> None:
    models = (write_text_gguf(tmp_path / "tiny-text.gguf", projector),
              write_mmproj_gguf(tmp_path / f"tiny-mmproj-{projector}.gguf", projector, N_EMBD))
    host, npu = servers["host"], servers["npu"]
    assert isinstance(host, RknpuServer) and isinstance(npu, RknpuServer)
    before = {"host": _per_op(host), "npu": _per_op(npu)}
    before_rows = _npu_rows(npu, PROJECTORS[projector].vit_rows)
    cpu = _answers(tmp_path, models, None)
    assert all(cpu), "the CPU-only run generated nothing to compare"
    assert _differ(*cpu), "the two images answer alike: the projector's output would not be checked"
    assert _tokens(_answers(tmp_path, models, servers["cpp"])) == _tokens(cpu), \
        "the C++ server differs: not a valid case"
    assert _answers(tmp_path, models, host) == cpu                     # the same kernels: bit-equal logprobs
    for seed, device, reference in zip(IMAGE_SEEDS, _answers(tmp_path, models, npu), cpu):
        agree(device, reference, what=f"{projector}, image {seed} on the NPU")
    assert host.alive() and npu.alive()
    _ran(host, before["host"], PROJECTORS[projector].ops)
    _ran(npu, before["npu"], PROJECTORS[projector].ops)
    rows = PROJECTORS[projector].vit_rows             # no text batch of the prompt has this many rows
    assert _npu_rows(npu, rows) > before_rows, ("the ViT's matmuls did not run on the NPU",
                                                npu.stats()["npu_matmuls_by_m"])
