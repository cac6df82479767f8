"""A b11739 client session recorded against the wheel's own C++ 8.0.0 server, replayed against
``rknpu serve --protocol 8 --device host``: every reply has the reference's size, every status
and computed size is equal, and every tensor read back (logits, ...) is within the bound two
ggml-cpu builds differ by.

Replies that describe the device rather than the session (free/total memory, max buffer size,
alignment) are only checked for size: they are properties of the server's device, not answers
the client's results depend on.
"""

from __future__ import annotations

import struct
from pathlib import Path

import numpy as np
import pytest

from ggml_rknpu.libggml.enums import GgmlOp, GgmlTensorFlag, GgmlType
from ggml_rknpu.server.rpc import proto8
from ggml_rknpu.server.rpc.wire import Cmd
from ggml_rknpu.server.tensor import RpcTensor
from support import rpc_record, wheel_client
from support.e2e_support import rknpu_server
from support.gguf_models import write_tiny_gguf
from support.greedy import CLOSE

PROMPT = "The capital of France is"
DEVICE_REPLIES = {Cmd.GET_DEVICE_MEMORY, Cmd.GET_MAX_SIZE, Cmd.GET_ALIGNMENT}
# Two ggml-cpu builds (the wheel's b11739, our pinned host plane) round f16 matmul activations
# differently: the tiny models' logits differ by up to 0.016 (measured, |logits| up to ~7). The
# bound is the near-tie rule's: a logit error <= CLOSE / 2 moves every log-probability by at most
# CLOSE (support.greedy); a wrong row or stale output is off by O(1).
RTOL, ATOL = 0.0, CLOSE / 2


@pytest.fixture(scope="module")
def client() -> wheel_client.Client:
    try:
        return wheel_client.client()
    except wheel_client.WheelUnavailable as exc:
        pytest.skip(str(exc))


def _record(client: wheel_client.Client, model: Path, tmp_path: Path) -> list[list[rpc_record.Message]]:
    with wheel_client.cpp_server(client, tmp_path) as cpp:
        proxy = rpc_record.RecordingProxy(cpp.port)
        try:
            wheel_client.greedy(client, model, PROMPT, 8, rpc=[f"127.0.0.1:{proxy.port}"])
        finally:
            proxy.close()
        assert "Starting RPC server v8.0.0" in cpp.log(), cpp.log()
    return [rpc_record.messages(c) for c in proxy.connections]


@pytest.mark.timeout(600)
@pytest.mark.parametrize("arch,device", [("llama", "host"), ("qwen3moe", "host"), ("llama", "sim-rknpu")])
def test_replayed_session_gets_the_reference_replies(tmp_path: Path, client, arch: str, device: str) -> None:
    model = write_tiny_gguf(tmp_path / f"tiny-{arch}.gguf", arch, "f16")
    recorded = _record(client, model, tmp_path)
    cmds = [m.cmd for conn in recorded for m in conn]
    assert Cmd.GRAPH_COMPUTE in cmds and Cmd.GRAPH_RECOMPUTE in cmds, sorted(set(cmds))
    _check_enums([m.payload for conn in recorded for m in conn if m.cmd == Cmd.GRAPH_COMPUTE])
    with rknpu_server(tmp_path, device=device, extra=("--protocol", "8")) as server:
        exchanges = rpc_record.replay(recorded, server.port)
        assert server.alive(), server.log()
    assert server.stats()["rejected"] == 0, server.log()
    assert len(exchanges) == sum(m.reply is not None for conn in recorded for m in conn)
    tensors_compared = 0
    for i, x in enumerate(exchanges):
        what = f"reply {i} ({Cmd(x.cmd).name})"
        assert len(x.tested) == len(x.reference), f"{what}: {len(x.tested)} bytes, reference {len(x.reference)}"
        if x.cmd in DEVICE_REPLIES:
            continue
        if x.cmd == Cmd.ALLOC_BUFFER:                  # a handle of its own; the size and success equal
            assert (x.tested[:8] != bytes(8)) == (x.reference[:8] != bytes(8)) and x.tested[8:] == x.reference[8:]
        elif x.cmd == Cmd.BUFFER_GET_BASE:
            assert x.tested != bytes(8), what
        elif x.cmd in (Cmd.GET_TENSOR, Cmd.GET_TENSOR_2D):
            (type_id,) = struct.unpack_from("<I", x.request, 8)
            if type_id == GgmlType.F32 and len(x.tested) % 4 == 0:
                np.testing.assert_allclose(np.frombuffer(x.tested, np.float32), np.frombuffer(x.reference, np.float32),
                                           rtol=RTOL, atol=ATOL, err_msg=what)
            else:
                assert x.tested == x.reference, what
            tensors_compared += 1
        else:
            assert x.tested == x.reference, f"{what}: {x.tested.hex()} vs reference {x.reference.hex()}"
    assert tensors_compared >= 8, tensors_compared                # the logits of every pass at least


def _check_enums(graphs: list[bytes]) -> None:
    """Every op, type and tensor flag in the client's real graphs is one of ours, and most nodes
    carry GGML_TENSOR_FLAG_COMPUTE (16), the bit the server runs nodes by (the rest are branches
    ggml_build_forward_select did not choose); test_e2e_client8_enums.py checks the enums."""
    known_flags = sum(int(f) for f in GgmlTensorFlag)
    computing = nodes = 0
    for payload in graphs:
        _, _, n_nodes = proto8.GRAPH_HEAD.unpack_from(payload, 0)
        node_ids = set(struct.unpack_from(f"<{n_nodes}Q", payload, proto8.GRAPH_HEAD.size))
        pos = proto8.GRAPH_HEAD.size + 8 * n_nodes
        (n_tensors,) = struct.unpack_from("<I", payload, pos)
        for i in range(n_tensors):
            t = RpcTensor.unpack_from(payload, pos + 4 + i * 296)
            assert t.op in set(GgmlOp) and t.type in set(GgmlType), t
            assert t.flags & ~known_flags == 0, f"{t.name}: flags {t.flags:#x}"
            if t.id in node_ids:
                nodes += 1
                computing += bool(t.flags & GgmlTensorFlag.COMPUTE)
    assert nodes and computing > nodes // 2, (computing, nodes)
