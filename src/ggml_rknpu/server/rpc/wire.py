"""ggml RPC protocol 7.0.0 on the wire: commands, the packed ``rpc_tensor``, framing.

Every layout here is the raw little-endian ``#pragma pack(1)`` struct the pinned
llama.cpp (commit 0c1e570, ``ggml/src/ggml-rpc/ggml-rpc.cpp``) sends; sizes and
offsets are taken from ``docs/ggml-rpc.md`` §3 (checked there with a compiled
probe). The protocol has no error reply: a request that does not have exactly the
size its command implies is rejected by closing the connection, so every fixed size
lives here as data and ``expected_payload`` is the one place that knows them.
"""

from __future__ import annotations

import struct
from enum import IntEnum

PROTO_VERSION = (7, 0, 0)  # RPC_PROTO_MAJOR/MINOR/PATCH [docs/ggml-rpc.md §1]


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


N_COMMANDS = 18  # NONE (18) and COUNT (19) are client-internal and never sent

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
PROTO_TEXT = ".".join(map(str, PROTO_VERSION))
USE_A_7X_CLIENT = (f"use a llama.cpp client built with RPC protocol {PROTO_VERSION[0]}.x (scripts/build-llama-cpp "
                   "--list shows the builds this project tests: the pinned 0c1e570 and b11434)")
# Requests of llama.cpp master's protocol 8.0.0 (b11458 on) [docs/server.md: Other protocol majors]
PROTO8_COMMANDS = {18: "SET_TENSOR_2D", 19: "GET_TENSOR_2D", 20: "COMM_INIT", 21: "COMM_ALLREDUCE", 22: "COMM_FREE"}
PROTO8_GRAPH_RECOMPUTE_SIZE = 12   # dev u32 + graph uid u64
# Before conn_caps the HELLO request had no payload (the 7.0.0 C++ server answers such a request
# with "HELLO request size mismatch ... client needs upgrade to protocol v7.x").
PROTO_BEFORE7_HELLO_SIZE = 0


def other_major(found: str) -> ProtocolError:
    """The refusal for a client of another protocol major, naming both versions and the fix."""
    return ProtocolError(f"the client speaks RPC protocol {found} ({PROTO_TEXT} here): {USE_A_7X_CLIENT}")


def hello_then_gone() -> str:
    """Log text for a client that closed right after our HELLO reply, before any command."""
    return (f"client closed the connection right after HELLO: it refused this server's RPC protocol {PROTO_TEXT} "
            f"(a llama.cpp client of another major, e.g. master's 8.0.0 from b11458, logs 'RPC server version "
            f"mismatch: {PROTO_TEXT}' and aborts); {USE_A_7X_CLIENT}")


def expected_payload(cmd: int, payload_size: int) -> None:
    """Check a request header before reading its payload; raise ProtocolError if impossible."""
    if cmd >= N_COMMANDS:
        if cmd in PROTO8_COMMANDS:
            raise other_major(f"8.x (command {cmd} is its {PROTO8_COMMANDS[cmd]})")
        raise ProtocolError(f"unknown command {cmd}")
    fixed = FIXED_PAYLOAD[Cmd(cmd)]
    if fixed is not None:
        if cmd == Cmd.GRAPH_RECOMPUTE and payload_size == PROTO8_GRAPH_RECOMPUTE_SIZE:
            raise other_major("8.x (GRAPH_RECOMPUTE carries a graph uid)")
        if cmd == Cmd.HELLO and payload_size == PROTO_BEFORE7_HELLO_SIZE:
            raise other_major("older than 7.0 (HELLO without conn_caps)")
        if payload_size != fixed:
            raise ProtocolError(f"{Cmd(cmd).name}: payload is {payload_size} bytes, expected {fixed}")
    elif cmd == Cmd.SET_TENSOR:
        if payload_size < SET_TENSOR_HEADER_SIZE:
            raise ProtocolError(f"SET_TENSOR: payload is {payload_size} bytes, needs at least {SET_TENSOR_HEADER_SIZE}")
    elif cmd == Cmd.GRAPH_COMPUTE:
        if payload_size < GRAPH_HEAD.size + 4 or payload_size > MAX_GRAPH_PAYLOAD:
            raise ProtocolError(f"GRAPH_COMPUTE: payload of {payload_size} bytes is outside [12, {MAX_GRAPH_PAYLOAD}]")


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
