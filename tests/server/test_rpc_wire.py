"""Wire layouts of ggml RPC 7.0.0: sizes and offsets from reference/ggml-rpc.md §3."""

from __future__ import annotations

import numpy as np
import pytest

from ggml_rknpu.libggml.enums import RPC_PROTO
from ggml_rknpu.server.rpc import wire
from ggml_rknpu.server.rpc.wire import Cmd, ProtocolError
from ggml_rknpu.server.tensor import RpcTensor


def test_protocol_version_matches_the_pinned_headers():
    assert wire.PROTO_VERSION == RPC_PROTO == (7, 0, 0)


# An independent description of rpc_tensor: the offset table of [ggml-rpc.md §3.3] as a numpy dtype.
RPC_TENSOR_DTYPE = np.dtype({
    "names": ["id", "type", "buffer", "ne", "nb", "op", "op_params", "flags",
              "src", "view_src", "view_offs", "data", "name", "use_count"],
    "formats": ["<u8", "<u4", "<u8", ("<u4", 4), ("<u4", 4), "<u4", ("<i4", 16), "<i4",
                ("<u8", 10), "<u8", "<u8", "<u8", "S64", "<i4"],
    "offsets": [0, 8, 12, 20, 36, 52, 56, 120, 124, 204, 212, 220, 228, 292],
    "itemsize": 296,
})


def test_rpc_tensor_size():
    assert wire.RPC_TENSOR.size == wire.RPC_TENSOR_SIZE == RPC_TENSOR_DTYPE.itemsize == 296


def test_struct_and_dtype_agree_on_a_packed_tensor():
    raw = wire.pack_tensor(id=0x1122334455667788, type=12, buffer=0xB0F0000000001, ne=(256, 3, 2, 1),
                           nb=(144, 144, 432, 864), data=0x1_0000_0040, op=29, op_params=(1, -2, 3),
                           flags=16, src=(7, 8), view_src=9, view_offs=64, name="blk.0.ffn_up.weight")
    rec = np.frombuffer(raw, dtype=RPC_TENSOR_DTYPE)[0]
    t = RpcTensor.unpack_from(raw)
    assert t.id == rec["id"] == 0x1122334455667788
    assert t.ne == tuple(rec["ne"]) == (256, 3, 2, 1)
    assert t.nb == tuple(rec["nb"]) == (144, 144, 432, 864)
    assert t.op_params[:3] == tuple(rec["op_params"][:3]) == (1, -2, 3)
    assert t.src[:3] == (7, 8, 0) and t.view_src == 9 and t.view_offs == 64
    assert t.data == rec["data"] == 0x1_0000_0040
    assert t.name == "blk.0.ffn_up.weight"
    # little-endian, no padding: the type sits at byte 8, data at byte 220
    assert raw[8:12] == (12).to_bytes(4, "little")
    assert raw[220:228] == (0x1_0000_0040).to_bytes(8, "little")


@pytest.mark.parametrize("cmd,size", [
    (Cmd.ALLOC_BUFFER, 12), (Cmd.GET_ALIGNMENT, 4), (Cmd.GET_MAX_SIZE, 4), (Cmd.BUFFER_GET_BASE, 8),
    (Cmd.FREE_BUFFER, 8), (Cmd.BUFFER_CLEAR, 9), (Cmd.SET_TENSOR_HASH, 312), (Cmd.GET_TENSOR, 312),
    (Cmd.COPY_TENSOR, 592), (Cmd.GET_DEVICE_MEMORY, 4), (Cmd.INIT_TENSOR, 296), (Cmd.GET_ALLOC_SIZE, 3260),
    (Cmd.HELLO, 24), (Cmd.DEVICE_COUNT, 0), (Cmd.GRAPH_RECOMPUTE, 4), (Cmd.MEMSET_TENSOR, 313),
])
def test_fixed_sizes_accepted_exactly(cmd, size):
    wire.expected_payload(cmd, size)
    for wrong in (size - 1, size + 1):
        if wrong >= 0:
            with pytest.raises(ProtocolError):
                wire.expected_payload(cmd, wrong)


def test_variable_sizes_and_unknown_commands():
    wire.expected_payload(Cmd.SET_TENSOR, 305)           # empty write is legal
    wire.expected_payload(Cmd.SET_TENSOR, 305 + 4096)
    with pytest.raises(ProtocolError):
        wire.expected_payload(Cmd.SET_TENSOR, 304)
    wire.expected_payload(Cmd.GRAPH_COMPUTE, 12)
    with pytest.raises(ProtocolError):
        wire.expected_payload(Cmd.GRAPH_COMPUTE, wire.MAX_GRAPH_PAYLOAD + 1)
    for cmd in (23, 200, 255):
        with pytest.raises(ProtocolError, match="unknown command"):
            wire.expected_payload(cmd, 0)
    for cmd in (18, 19, 22):                              # protocol 8's new commands, named as such
        with pytest.raises(ProtocolError, match=r"RPC protocol 8\.x .* \(7\.0\.0 here\)"):
            wire.expected_payload(cmd, 0)
    assert len(Cmd) == wire.N_COMMANDS == 18
