"""rpc_tensor → a checked tensor: valid type, sane shape and strides, bytes inside its buffer.

This is the one place a client-supplied tensor description becomes something the
server touches memory through (the host ops' ``TensorRef``). The rules mirror
``ggml_nbytes`` and C++ ``deserialize_tensor``: the tensor's bytes
``[data, data + nbytes)`` must lie inside the buffer its handle names; on top of
that we reject what would let a tiny span describe an enormous array (zero strides
over u32 counts), a quantized row that is not whole blocks, and a view whose
address disagrees with ``view_src.data + view_offs``.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ggml_rknpu.libggml.enums import TYPE_TRAITS
from ggml_rknpu.server.buffers import BufferTable, RpcBuffer
from ggml_rknpu.server.ops.vocabulary import TensorRef, tensor_span
from ggml_rknpu.server.rpc.wire import RPC_TENSOR, ProtocolError, tensor_name

# Largest logical size of one tensor (elements × element size). ne/nb are u32 on the
# wire (P9), so no real tensor row exceeds 4 GiB; a whole tensor above this is a
# malformed or hostile description, not a model.
MAX_TENSOR_LOGICAL_BYTES = 1 << 34

_TRAITS: dict[int, tuple[int, int]] = {int(t): v for t, v in TYPE_TRAITS.items() if v[1] > 0}


@dataclass(frozen=True, slots=True)
class RpcTensor:
    """The raw fields of one rpc_tensor, unchecked."""

    id: int
    type: int
    buffer: int
    ne: tuple[int, int, int, int]
    nb: tuple[int, int, int, int]
    op: int
    op_params: tuple[int, ...]
    flags: int
    src: tuple[int, ...]
    view_src: int
    view_offs: int
    data: int
    name: str
    use_count: int

    @classmethod
    def unpack_from(cls, payload: bytes | memoryview, offset: int = 0) -> RpcTensor:
        f = RPC_TENSOR.unpack_from(payload, offset)
        return cls(
            id=f[0], type=f[1], buffer=f[2], ne=f[3:7], nb=f[7:11], op=f[11], op_params=f[12:28],
            flags=f[28], src=f[29:39], view_src=f[39], view_offs=f[40], data=f[41],
            name=tensor_name(f[42]), use_count=f[43],
        )


def type_traits(type_id: int, what: str) -> tuple[int, int]:
    """(block_size, type_size) of a ggml type, or ProtocolError for ids this build lacks."""
    traits = _TRAITS.get(type_id)
    if traits is None:
        raise ProtocolError(f"{what}: invalid ggml type {type_id}")
    return traits


def nbytes(t: RpcTensor, what: str = "tensor") -> int:
    """``ggml_nbytes`` of the tensor, after checking the shape makes sense for its type."""
    block, type_size = type_traits(t.type, what)
    if any(n == 0 for n in t.ne):
        return 0
    if block > 1:
        if t.ne[0] % block != 0:
            raise ProtocolError(f"{what} '{t.name}': ne0={t.ne[0]} is not a multiple of the block size {block}")
        if t.nb[0] != type_size:
            raise ProtocolError(f"{what} '{t.name}': quantized nb0={t.nb[0]} != block bytes {type_size}")
    logical = t.ne[0] * t.ne[1] * t.ne[2] * t.ne[3] * type_size // block
    if logical > MAX_TENSOR_LOGICAL_BYTES:
        raise ProtocolError(f"{what} '{t.name}': absurd size, ne={t.ne} ({logical} bytes)")
    return tensor_span(t.type, t.ne, t.nb)


@dataclass(eq=False, slots=True)
class CheckedTensor:
    """An rpc_tensor whose bytes are known to be inside ``buffer`` at [start, end)."""

    rpc: RpcTensor
    buffer: RpcBuffer | None     # None: empty (nbytes 0) or, in a graph, on another backend
    start: int
    end: int

    @property
    def usable(self) -> bool:
        """Its bytes can be read or written here (backed, or empty)."""
        return self.buffer is not None or any(n == 0 for n in self.rpc.ne)

    @property
    def raw(self) -> np.ndarray:
        if self.buffer is None:
            return np.empty(0, dtype=np.uint8)
        return self.buffer.array[self.start:self.end]

    def ref(self) -> TensorRef:
        """The ``TensorRef`` the host ops work on."""
        t = self.rpc
        return TensorRef(type=t.type, ne=t.ne, nb=t.nb, raw=self.raw)


def unbacked_reason(t: RpcTensor) -> str:
    return "no buffer on this server" if t.buffer == 0 else f"unknown buffer {t.buffer:#x}"


def check_tensor(t: RpcTensor, buffers: BufferTable, what: str, *, allow_unbacked: bool = False) -> CheckedTensor:
    """Validate one tensor against the connection's buffers (C++ ``deserialize_tensor``, stricter).

    ``allow_unbacked``: a graph may list tensors that live on another backend (with partial
    offload the client sends e.g. views of a CPU-side KV cache as no-op nodes). They are
    accepted with ``buffer=None`` and the planner rejects any node that would touch them.
    """
    size = nbytes(t, what)
    buf = buffers.find(t.buffer) if t.buffer else None
    if buf is None:
        if size == 0 or allow_unbacked:
            return CheckedTensor(t, None, 0, 0)
        raise ProtocolError(f"{what} '{t.name}': {unbacked_reason(t)} for {size} bytes of data")
    start, end = buf.span(t.data, size, f"{what} '{t.name}'")
    return CheckedTensor(t, buf, start, end)
