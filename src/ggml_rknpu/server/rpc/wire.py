"""ggml RPC protocols 7.0.0 and 8.0.0 on the wire: commands, the packed ``rpc_tensor``, framing.

Every layout here is the raw little-endian ``#pragma pack(1)`` struct llama.cpp sends:
7.0.0 from the pinned build (commit 0c1e570, ``ggml/src/ggml-rpc/ggml-rpc.cpp``), 8.0.0
from upstream PR #26610 (llama.cpp b11458 on); sizes and offsets are taken from
``docs/ggml-rpc.md`` §3 and §4. The protocol has no error reply: a request that does not
have exactly the size its command implies is rejected by closing the connection, so every
fixed size lives here as data and ``expected_payload`` is the one place that knows them.
The 8.0.0 layouts of the commands that changed are in ``proto8.py``.
"""

from __future__ import annotations

import struct
from enum import IntEnum

PROTO_VERSION = (7, 0, 0)  # RPC_PROTO_MAJOR/MINOR/PATCH of the pinned build [docs/ggml-rpc.md §1]
# Every major this server speaks, with the version its HELLO reply carries [docs/ggml-rpc.md §4.1]
PROTO_VERSIONS: dict[int, tuple[int, int, int]] = {7: PROTO_VERSION, 8: (8, 0, 0)}


class Cmd(IntEnum):
    """Request command ids [docs/ggml-rpc.md §3.4]; HELLO == 14 is pinned by a static_assert."""

    ALLOC_BUFFER = 0
    GET_ALIGNMENT = 1
    GET_MAX_SIZE = 2
    BUFFER_GET_BASE = 3
    FREE_BUFFER = 4
    BUFFER_CLEAR = 5
    SET_TENSOR = 6
    SET_TENSOR_HASH = 7
    GET_TENSOR = 8
    COPY_TENSOR = 9
    GRAPH_COMPUTE = 10
    GET_DEVICE_MEMORY = 11
    INIT_TENSOR = 12
    GET_ALLOC_SIZE = 13
    HELLO = 14
    DEVICE_COUNT = 15
    GRAPH_RECOMPUTE = 16
    MEMSET_TENSOR = 17
    # protocol 8.0.0 only [docs/ggml-rpc.md §4.2]
    SET_TENSOR_2D = 18
    GET_TENSOR_2D = 19
    COMM_INIT = 20
    COMM_ALLREDUCE = 21
    COMM_FREE = 22


N_COMMANDS = 23  # ids of every major; the client-internal NONE / COUNT are never sent
# Command ids each major accepts: 7.0.0 has 0-17 (its NONE is 18), 8.0.0 has 0-22 (NONE is 23)
COMMANDS_OF: dict[int, int] = {7: 18, 8: 23}

# Request framing: u8 cmd | u64 payload_size [docs/ggml-rpc.md §3.1]
REQUEST_HEADER = struct.Struct("<BQ")
# Response framing: u64 payload_size
RESPONSE_HEADER = struct.Struct("<Q")

GGML_MAX_DIMS = 4
GGML_MAX_SRC = 10
GGML_MAX_OP_PARAMS_I32 = 16
GGML_MAX_NAME = 64

# rpc_tensor, 296 bytes [docs/ggml-rpc.md §3.3]
RPC_TENSOR = struct.Struct(
    "<Q"      # 0   id (client ggml_tensor*)
    "I"       # 8   type
    "Q"       # 12  buffer (remote_ptr)
    "4I"      # 20  ne[4]  (u32, P9)
    "4I"      # 36  nb[4]  (u32, P9)
    "I"       # 52  op
    "16i"     # 56  op_params
    "i"       # 120 flags
    "10Q"     # 124 src[10]
    "Q"       # 204 view_src
    "Q"       # 212 view_offs
    "Q"       # 220 data (device address)
    "64s"     # 228 name
    "i"       # 292 use_count
)
RPC_TENSOR_SIZE = 296
assert RPC_TENSOR.size == RPC_TENSOR_SIZE

# Fixed request layouts (payload after the 9-byte header) [docs/ggml-rpc.md §3.4]
HELLO_REQ = struct.Struct("<24s")                 # conn_caps
HELLO_RSP = struct.Struct("<BBBB24s")             # major minor patch pad conn_caps
DEV_REQ = struct.Struct("<I")                     # GET_ALIGNMENT, GET_MAX_SIZE, GET_DEVICE_MEMORY, GRAPH_RECOMPUTE
ALLOC_BUFFER_REQ = struct.Struct("<IQ")           # dev, size
ALLOC_BUFFER_RSP = struct.Struct("<QQ")           # remote_ptr, remote_size
U64 = struct.Struct("<Q")                         # BUFFER_GET_BASE/FREE_BUFFER req, several responses
U32 = struct.Struct("<I")                         # DEVICE_COUNT response
U8 = struct.Struct("<B")                          # SET_TENSOR_HASH / COPY_TENSOR responses
BUFFER_CLEAR_REQ = struct.Struct("<QB")           # remote_ptr, value
DEVICE_MEMORY_RSP = struct.Struct("<QQ")          # free, total
SET_TENSOR_TAIL = struct.Struct("<BQ")            # after T: cache_flag, offset; then data
SET_TENSOR_HEADER_SIZE = RPC_TENSOR_SIZE + SET_TENSOR_TAIL.size   # 305
TENSOR_OFFSET_U64 = struct.Struct("<QQ")          # after T: offset, size (GET_TENSOR) / offset, hash (SET_TENSOR_HASH)
MEMSET_TAIL = struct.Struct("<QQB")               # after T: offset, size, value
GRAPH_HEAD = struct.Struct("<II")                 # dev, n_nodes; then u64 ids, u32 n_tensors, tensors

assert SET_TENSOR_HEADER_SIZE == 305
assert RPC_TENSOR_SIZE + TENSOR_OFFSET_U64.size == 312
assert RPC_TENSOR_SIZE + MEMSET_TAIL.size == 313

# Exact payload size per fixed-size command; None = variable (checked by its handler).
FIXED_PAYLOAD: dict[Cmd, int | None] = {
    Cmd.ALLOC_BUFFER: ALLOC_BUFFER_REQ.size,                       # 12
    Cmd.GET_ALIGNMENT: DEV_REQ.size,                               # 4
    Cmd.GET_MAX_SIZE: DEV_REQ.size,
    Cmd.BUFFER_GET_BASE: U64.size,                                 # 8
    Cmd.FREE_BUFFER: U64.size,
    Cmd.BUFFER_CLEAR: BUFFER_CLEAR_REQ.size,                       # 9
    Cmd.SET_TENSOR: None,                                          # >= 305
    Cmd.SET_TENSOR_HASH: RPC_TENSOR_SIZE + TENSOR_OFFSET_U64.size,  # 312
    Cmd.GET_TENSOR: RPC_TENSOR_SIZE + TENSOR_OFFSET_U64.size,      # 312
    Cmd.COPY_TENSOR: 2 * RPC_TENSOR_SIZE,                          # 592
    Cmd.GRAPH_COMPUTE: None,                                       # checked against its counts
    Cmd.GET_DEVICE_MEMORY: DEV_REQ.size,
    Cmd.INIT_TENSOR: RPC_TENSOR_SIZE,                              # 296
    Cmd.GET_ALLOC_SIZE: DEV_REQ.size + (1 + GGML_MAX_SRC) * RPC_TENSOR_SIZE,  # 3260
    Cmd.HELLO: HELLO_REQ.size,                                     # 24
    Cmd.DEVICE_COUNT: 0,
    Cmd.GRAPH_RECOMPUTE: DEV_REQ.size,
    Cmd.MEMSET_TENSOR: RPC_TENSOR_SIZE + MEMSET_TAIL.size,         # 313
}
# The 8.0.0 sizes that differ (the new commands and GRAPH_RECOMPUTE; GRAPH_COMPUTE and
# SET_TENSOR_2D are variable) [docs/ggml-rpc.md §4.2]
FIXED_PAYLOAD_8: dict[Cmd, int | None] = FIXED_PAYLOAD | {
    Cmd.GRAPH_RECOMPUTE: 12,                                       # dev u32, uid u64
    Cmd.SET_TENSOR_2D: None,                                       # >= 328
    Cmd.GET_TENSOR_2D: RPC_TENSOR_SIZE + 32,                       # 328: offset, size, n_copies, stride
    Cmd.COMM_INIT: 80,                                             # dev, rank, world, port u32; host char[64]
    Cmd.COMM_ALLREDUCE: DEV_REQ.size + RPC_TENSOR_SIZE,            # 300
    Cmd.COMM_FREE: DEV_REQ.size,                                   # 4
}
TENSOR_2D_HEADER_SIZE = RPC_TENSOR_SIZE + 32                       # SET_TENSOR_2D before its rows
GRAPH_HEAD_8_SIZE = 16                                             # dev u32, uid u64, n_nodes u32
assert FIXED_PAYLOAD[Cmd.GET_ALLOC_SIZE] == 3260

# Largest GRAPH_COMPUTE payload accepted before reading it: a 70B-class graph is a few MB;
# anything near this is an attack or a corrupted stream, not a model.
MAX_GRAPH_PAYLOAD = 256 << 20
MAX_GRAPH_NODES = 1 << 20


class ProtocolError(Exception):
    """A request that breaks the protocol; the connection is closed, the server lives on."""


# What to tell a user whose client speaks another protocol major. The HELLO request carries
# no version (only conn_caps, same layout in 7.x and 8.x): the client compares the major we
# answer with its own and aborts ("RPC server version mismatch"), so the server sees either
# that abort or, from a client that goes on anyway, requests only another major sends.
# Requests of llama.cpp master's protocol 8.0.0 (b11458 on) [docs/ggml-rpc.md §4.2]
PROTO8_COMMANDS = {int(c): c.name for c in Cmd if c >= COMMANDS_OF[7]}
# Before conn_caps the HELLO request had no payload (the 7.0.0 C++ server answers such a request
# with "HELLO request size mismatch ... client needs upgrade to protocol v7.x").
PROTO_BEFORE7_HELLO_SIZE = 0
CLIENTS_OF = {7: "the pinned build and b11434 (scripts/build-llama-cpp --list)",
              8: "llama.cpp b11458 and later, e.g. the llama-cpp-py-sync==0.11739 wheel"}


def version_text(major: int) -> str:
    return ".".join(map(str, PROTO_VERSIONS[major]))


def protocol_advice(client_major: int | None) -> str:
    """The fix, as a command: which --protocol serves which clients."""
    if client_major in PROTO_VERSIONS:
        return f"start it with `rknpu serve --protocol {client_major}` (for {CLIENTS_OF[client_major]})"
    return "; ".join(f"`rknpu serve --protocol {m}` serves {CLIENTS_OF[m]}" for m in PROTO_VERSIONS)


def other_major(found: str, major: int, client_major: int | None) -> ProtocolError:
    """The refusal for a client of another protocol major, naming both versions and the fix."""
    return ProtocolError(f"the client speaks RPC protocol {found} ({version_text(major)} here): "
                         f"{protocol_advice(client_major)}")


def hello_then_gone(major: int, other_port: int | None) -> str:
    """Log text for a client that closed right after our HELLO reply, before any command.

    Usually a client of the other major (it reads our version and aborts); a client of this
    major may also drop a connection it opened and never used, so this is advice, not a verdict.
    ``other_port``: where this server answers the other major (``--protocol auto``), if it does."""
    other = next(m for m in PROTO_VERSIONS if m != major)
    head = (f"client closed the connection right after HELLO: if it logged 'RPC server version mismatch: "
            f"{version_text(major)}', it speaks another RPC protocol than this port's {version_text(major)} "
            f"(e.g. {version_text(other)}); ")
    if other_port is not None:
        return head + f"connect it to port {other_port}, where this server speaks {version_text(other)}"
    return head + protocol_advice(other)


def expected_payload(cmd: int, payload_size: int, major: int = 7) -> None:
    """Check a request header before reading its payload; raise ProtocolError if impossible."""
    if cmd >= COMMANDS_OF[major]:
        if major == 7 and cmd in PROTO8_COMMANDS:
            raise other_major(f"8.x (command {cmd} is its {PROTO8_COMMANDS[cmd]})", major, 8)
        raise ProtocolError(f"unknown command {cmd}")
    fixed = (FIXED_PAYLOAD_8 if major == 8 else FIXED_PAYLOAD)[Cmd(cmd)]
    if fixed is not None:
        if cmd == Cmd.GRAPH_RECOMPUTE and payload_size != fixed and payload_size in (4, 12):
            found = 8 if payload_size == 12 else 7
            raise other_major(f"{found}.x (GRAPH_RECOMPUTE {'with' if found == 8 else 'without'} a graph uid)",
                              major, found)
        if cmd == Cmd.HELLO and payload_size == PROTO_BEFORE7_HELLO_SIZE:
            raise other_major("older than 7.0 (HELLO without conn_caps)", major, None)
        if payload_size != fixed:
            raise ProtocolError(f"{Cmd(cmd).name}: payload is {payload_size} bytes, expected {fixed}")
    elif cmd in (Cmd.SET_TENSOR, Cmd.SET_TENSOR_2D):
        least = SET_TENSOR_HEADER_SIZE if cmd == Cmd.SET_TENSOR else TENSOR_2D_HEADER_SIZE
        if payload_size < least:
            raise ProtocolError(f"{Cmd(cmd).name}: payload is {payload_size} bytes, needs at least {least}")
    elif cmd == Cmd.GRAPH_COMPUTE:
        least = (GRAPH_HEAD_8_SIZE if major == 8 else GRAPH_HEAD.size) + 4
        if payload_size < least or payload_size > MAX_GRAPH_PAYLOAD:
            raise ProtocolError(f"GRAPH_COMPUTE: payload of {payload_size} bytes is outside [{least}, "
                                f"{MAX_GRAPH_PAYLOAD}]")


def tensor_name(raw: bytes) -> str:
    """The NUL-padded name field as text (never fails on bad bytes)."""
    return raw.split(b"\0", 1)[0].decode("utf-8", "replace")


def pack_response(payload: bytes) -> bytes:
    """u64 size | payload."""
    return RESPONSE_HEADER.pack(len(payload)) + payload


def pack_request(cmd: int, payload: bytes = b"") -> bytes:
    """u8 cmd | u64 size | payload (used by clients and tests)."""
    return REQUEST_HEADER.pack(cmd, len(payload)) + payload


def pack_tensor(
    *, id: int, type: int, buffer: int, ne: tuple[int, ...], nb: tuple[int, ...], data: int,
    op: int = 0, op_params: tuple[int, ...] = (), flags: int = 0, src: tuple[int, ...] = (),
    view_src: int = 0, view_offs: int = 0, name: str = "", use_count: int = 0,
) -> bytes:
    """Serialize one rpc_tensor (clients and tests; the server only parses)."""
    params = list(op_params) + [0] * (GGML_MAX_OP_PARAMS_I32 - len(op_params))
    srcs = list(src) + [0] * (GGML_MAX_SRC - len(src))
    return RPC_TENSOR.pack(
        id, type, buffer, *ne, *nb, op, *params, flags, *srcs, view_src, view_offs, data,
        name.encode()[:GGML_MAX_NAME], use_count,
    )
