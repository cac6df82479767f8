"""llama.cpp's tensor-parallel split (``-sm tensor``, the b11739 wheel's ``split_mode="tensor"``)
over several protocol-8 servers: the CPU-only greedy tokens of the same client, with flash
attention on (upstream requires it for this split). Two servers pair through COMM_INIT and sum
partial results server to server (COMM_ALLREDUCE); three fall back to the client's copies
(upstream's communicator is pairwise). A mixed pair (rknpu serve + the wheel's C++ 8.0.0 server)
pairs too: the link is upstream's wire format. gemma3-270m is not a case: the b11739 client
itself asserts in ggml-backend-meta.cpp on it, with its own servers as well.
"""

from __future__ import annotations

from contextlib import ExitStack
from pathlib import Path

import pytest

from support import wheel_client
from support.e2e_support import rknpu_server
from support.gguf_models import write_tiny_gguf
from support.greedy import agree

PROMPT = "The capital of France is"
N_PREDICT = 12
FLASH_ATTN_ON = 1


@pytest.fixture(scope="module")
def client() -> wheel_client.Client:
    try:
        return wheel_client.client()
    except wheel_client.WheelUnavailable as exc:
        pytest.skip(str(exc))


@pytest.mark.timeout(900)
@pytest.mark.parametrize("arch,servers", [("llama", "ours,ours"), ("qwen2", "ours,ours"), ("llama", "ours,cpp"), ("llama", "cpp,ours"),
                                          ("llama", "ours,ours,ours")])
def test_tensor_split_follows_the_clients_cpu_run(tmp_path: Path, client, arch: str, servers: str) -> None:
    model = write_tiny_gguf(tmp_path / f"tiny-{arch}.gguf", arch, "f16")
    cpu = wheel_client.greedy(client, model, PROMPT, N_PREDICT, flash_attn=FLASH_ATTN_ON)
    kinds = servers.split(",")
    with ExitStack() as stack:
        started = [stack.enter_context(rknpu_server(tmp_path, device="host", extra=("--protocol", "8"),
                                                    name=f"rank{i}") if kind == "ours"
                                       else wheel_client.cpp_server(client, tmp_path))
                   for i, kind in enumerate(kinds)]
        got = wheel_client.greedy(client, model, PROMPT, N_PREDICT, rpc=[s.endpoint for s in started],
                                  split_mode="tensor", flash_attn=FLASH_ATTN_ON)
        assert all(s.alive() for s in started), "\n".join(s.log() for s in started)
    ours = [s for s in started if hasattr(s, "stats")]
    for s in ours:
        stats = s.stats()
        assert stats["rejected"] == 0, s.log()
        reduced = stats["commands"].get("COMM_ALLREDUCE", 0)
        assert (reduced > 0) == (len(kinds) == 2), (servers, stats["commands"])
        assert stats["commands"].get("GRAPH_COMPUTE", 0) > 0
    agree(got.choices, cpu.choices, what=f"{arch} split over {servers}")
