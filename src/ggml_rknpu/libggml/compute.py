"""Real ggml tensors over the server's buffers, and ggml-cpu graphs prepared once, run many times.

A :class:`HostContext` belongs to one graph plan: a no-alloc ggml context holding one ggml
tensor per tensor of the received graph (``data`` pointing into the server's own buffer
memory, views as views, ``op``/``op_params``/``flags`` as the client sent them) and the
segment graphs. :meth:`HostContext.segment` turns a run of nodes into a :class:`HostCompute`:
a ``ggml_cgraph`` and a ``ggml_cplan`` made once, so a replay is one ``ggml_graph_compute``
call. Closing the context frees every tensor and graph of the plan; it holds a reference to
every numpy buffer its pointers point into, and scratch bound for one run
(:meth:`HostCompute.bound`) is unbound after it: no pointer outlives the memory it names.

Only validated graphs may come here (``server.ops.rules``): ggml-cpu trusts its input.
"""

from __future__ import annotations

import ctypes
import os
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ggml_rknpu.libggml import abi
from ggml_rknpu.libggml.enums import GgmlOp
from ggml_rknpu.libggml.lib import GGML_STATUS_SUCCESS, Ggml, TensorP

WORK_ALIGN = 64                    # work buffer: cache-line aligned (ggml-cpu pads its own use)
_EMPTY = np.zeros(WORK_ALIGN, dtype=np.uint8)   # data of empty tensors: a valid, unused address


class HostComputeError(RuntimeError):
    """ggml_graph_compute did not succeed (its status is in the message)."""


def default_threads() -> int:
    """Host threads when --threads is not given: all cores but one, at most 4.

    An RK3588 has four Cortex-A76 (big) cores beside four A55: 4 threads there. On a 2-core
    machine 1 thread, so the client and the NPU driver keep a core."""
    return max(1, min(4, (os.cpu_count() or 1) - 1))


class Threads:
    """ggml-cpu's thread count and its threadpool, made once per server.

    Always a threadpool, even for one thread: with none, every ``ggml_graph_compute`` builds
    and frees a disposable one (a few allocations per segment, hundreds of segments per
    token). ``poll = 0``: idle workers sleep on a condition variable between graphs instead of
    spinning; the pinned build runs its workers on OpenMP, whose threads are told to sleep too
    (``OMP_WAIT_POLICY=PASSIVE``, set before libgomp loads, ``libggml.lib``), so they never
    starve the NPU driver or the client of a core."""

    def __init__(self, g: Ggml, n_threads: int) -> None:
        if n_threads < 1:
            raise ValueError(f"host threads must be >= 1, not {n_threads}")
        self.n = n_threads
        self._g = g
        params = abi.ThreadpoolParams()
        g.ggml_threadpool_params_init(ctypes.byref(params), n_threads)
        params.poll = 0
        self.pool: int | None = g.ggml_threadpool_new(ctypes.byref(params))
        if not self.pool:
            raise RuntimeError(f"ggml_threadpool_new({n_threads}) failed")

    def close(self) -> None:
        pool, self.pool = self.pool, None      # taken before the free: see HostContext.close
        if pool:
            self._g.ggml_threadpool_free(pool)


@dataclass(eq=False)
class HostCompute:
    """One ggml_cgraph with its cplan: ``run()`` computes its nodes with ggml-cpu.

    The call is prepared once (``Ggml.graph_compute_raw`` with the cplan's address): a
    replay calls it once per host segment."""

    g: Ggml
    graph: int
    cplan: abi.Cplan
    nodes: tuple[TensorP, ...]
    cplan_address: int = field(init=False)

    @property
    def n_nodes(self) -> int:
        return len(self.nodes)

    def __post_init__(self) -> None:
        self.cplan_address = ctypes.addressof(self.cplan)

    def run(self) -> None:
        status = self.g.graph_compute_raw(self.graph, self.cplan_address)
        if status != GGML_STATUS_SUCCESS:
            raise HostComputeError(f"ggml_graph_compute returned status {status}")

    @contextmanager
    def bound(self, *bindings: tuple[TensorP, np.ndarray]) -> Iterator[None]:
        """Each tensor's data at its array (C-contiguous, at least the tensor's bytes) inside the
        block, at the empty address after it: scratch that exists only while a step runs."""
        for t, array in bindings:
            if not array.flags.c_contiguous or array.nbytes < self.g.ggml_nbytes(t):
                raise ValueError(f"'{t.contents.name.decode()}' needs {self.g.ggml_nbytes(t)} "
                                 f"contiguous bytes, not a {array.nbytes}-byte array")
        try:
            for t, array in bindings:
                t.contents.data = array.ctypes.data
            yield
        finally:
            for t, _ in bindings:
                t.contents.data = _EMPTY.ctypes.data


@dataclass(eq=False)
class HostContext:
    """The ggml context of one plan: its tensors, its graphs, their work buffer."""

    g: Ggml
    threads: Threads
    n_tensors: int
    graph_sizes: tuple[int, ...]
    ctx: int = 0
    keep: dict[int, Any] = field(default_factory=dict)   # buffers the tensors point into, by id
    work: np.ndarray | None = None
    _computes: list[HostCompute] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.ctx = self.g.context(self.n_tensors, self.graph_sizes)

    def tensor(self, type_: int, ne: tuple[int, ...], nb: tuple[int, ...], op: int,
               op_params: tuple[int, ...], flags: int, name: str,
               data: tuple[np.ndarray, int] | None) -> TensorP:
        """A ggml tensor with the client's geometry; ``data`` = (buffer array, byte offset) or None."""
        t = self.g.new_tensor(self.ctx, type_, ne)
        c = t.contents
        c.nb[:] = nb
        c.op = op
        c.op_params[:len(op_params)] = op_params
        c.flags = flags
        c.name = name.encode()[:abi.GGML_MAX_NAME - 1]
        if data is None:
            c.data = _EMPTY.ctypes.data
        else:
            array, offset = data
            self.keep[id(array)] = array
            c.data = array.ctypes.data + offset
        return t

    @staticmethod
    def link(t: TensorP, srcs: list[TensorP | None], view_src: TensorP | None, view_offs: int) -> None:
        c = t.contents
        for i, s in enumerate(srcs):
            c.src[i] = s if s is not None else TensorP()
        c.view_src = view_src if view_src is not None else TensorP()
        c.view_offs = view_offs

    def copy_node(self, dst: TensorP, source: np.ndarray, name: str) -> TensorP:
        """A CPY node writing ``source`` (contiguous, ``dst``'s type and element count) over
        ``dst``'s bytes, as ``ggml_cpy(source, dst)`` builds it (a view of ``dst``)."""
        d = dst.contents
        ne = tuple(d.ne)
        if not source.flags.c_contiguous or source.nbytes != self.g.ggml_nbytes(dst):
            raise ValueError(f"copy into '{d.name.decode()}': source is not {self.g.ggml_nbytes(dst)} contiguous bytes")
        src = self.new_tensor_contiguous(d.type, ne, name, source)
        node = self.tensor(d.type, ne, tuple(d.nb), GgmlOp.CPY, (), abi.GGML_TENSOR_FLAG_COMPUTE, name, None)
        node.contents.data = d.data
        self.link(node, [src, dst], dst, 0)
        return node

    def new_tensor_contiguous(self, type_: int, ne: tuple[int, ...], name: str, array: np.ndarray) -> TensorP:
        """A leaf tensor over a whole contiguous numpy array (ggml's default strides)."""
        t = self.g.new_tensor(self.ctx, type_, ne)
        t.contents.name = name.encode()[:abi.GGML_MAX_NAME - 1]
        self.keep[id(array)] = array
        t.contents.data = array.ctypes.data
        return t

    def segment(self, nodes: list[TensorP]) -> HostCompute:
        """A graph of ``nodes`` in this order, planned for the server's threads."""
        graph = self.g.ggml_new_graph_custom(self.ctx, max(1, len(nodes)), False)
        if not graph:
            raise MemoryError("ggml context out of room for a graph")
        for t in nodes:
            self.g.ggml_graph_add_node(graph, t)
        cplan = self.g.ggml_graph_plan(graph, self.threads.n, self.threads.pool)
        hc = HostCompute(self.g, graph, cplan, tuple(nodes))
        self._computes.append(hc)
        return hc

    @property
    def nbytes(self) -> int:
        """Host bytes it holds: the context (tensor headers, graphs) and the work buffer."""
        return (self.g.ggml_get_mem_size(self.ctx) if self.ctx else 0) + (self.work.nbytes if self.work is not None else 0)

    def finish(self) -> None:
        """Allocate one work buffer for all graphs (they run one after another)."""
        size = max((c.cplan.work_size for c in self._computes), default=0)
        if size:
            self.work = np.zeros(size + WORK_ALIGN, dtype=np.uint8)
            base = self.work.ctypes.data
            aligned = base + (-base % WORK_ALIGN)
            for c in self._computes:
                c.cplan.work_data = aligned

    def close(self) -> None:
        """Free the context, then drop the buffers it pointed into; idempotent. The handle is
        taken before the free: an exception landing as the ctypes call returns (a signal
        handler's) must not leave it set for a second free (docs/server.md "Stopping")."""
        ctx, self.ctx = self.ctx, 0
        if ctx:
            self.g.ggml_free(ctx)
        self._computes.clear()
        self.keep.clear()
        self.work = None
