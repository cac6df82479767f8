"""Execution of conv tasks: ``execute_conv`` one task (features, weights, GEMM, output write),
``BulkConv`` the tasks of one run batched into fewer, larger GEMMs.

Equivalence to task-by-task execution: ``BulkConv``'s doc and tests/sim/test_sim_bulk.py;
docs/simulator.md "Bulk execution"."""

from __future__ import annotations

from dataclasses import replace

import numpy as np

from ggml_rknpu.hw import limits
from ggml_rknpu.sim.conv import (
    NUMPY_DTYPE,
    ConvTask,
    DmaRead,
    check_features,
    check_output,
    extent,
    feature_span,
    output_span,
    overlap,
    write_output,
)
from ggml_rknpu.sim.gemm import GemmFn, multiply
from ggml_rknpu.sim.memory import DeviceMemory, note_device_write
from ggml_rknpu.sim.operands import OperandCache


def execute_conv(memory: DeviceMemory, task: ConvTask, cache: OperandCache,
                 gemm: GemmFn = multiply) -> None:
    a = cache.features(memory, task)
    b = cache.weights(memory, task)
    write_output(memory, task, gemm(task, a, b))
    span = output_span(task)
    cache.invalidate(task.dst_addr, span)
    note_device_write(memory, task.dst_addr, span)


# accumulator-overflow NotModeled; fp16 tasks cannot fail once their addresses are mapped.
INT8_NO_OVERFLOW_K = 1 << 17


def _cannot_fail_once_mapped(task: ConvTask) -> bool:
    return task.precision != "int8" or task.channels < INT8_NO_OVERFLOW_K


class BulkConv:
    """Execute the conv tasks of one run in bulk, as one task of all their rows or kernels -
    one feature read, one GEMM, one output write - instead of one small set of numpy calls
    each. Two kinds of batch:

    * M tiles: consecutive tasks over the same weights (the same kernels, the next rows of
      the same feature and output planes);
    * N tiles of one row: consecutive one-row tasks over the same features whose weights
      follow each other in memory (whole kernel groups, packed exactly) and whose outputs
      are the next channel planes (e.g. gemma3-270m's output projection: 32 tiles of 8192
      kernels become one GEMM over 262144). Only for one row, and never a one-kernel task
      (numpy computes its 1 x 1 result with sdot).

    Equivalent to ``execute_conv`` task by task up to the fp32 summation order (exact for
    int8; for fp16 a BLAS picks its kernel per shape, so the merged GEMM may round an
    element differently, which the model's fp16 numerics allow: docs/simulator.md), because
    a task joins the pending batch only if (a) nothing can fail once its addresses are
    mapped (fp16; int8 with K < 2^17),
    and its features, weights and output were checked mapped when it was submitted (a
    fault flushes the batch first, then raises the same error ``execute_conv`` would);
    (b) the batch's outputs overlap none of its inputs; (c) the caller flushes before
    anything else reads memory the batch writes (``writes_into``: the next regcmd fetch)
    and at the end of the run. tests/sim/test_sim_bulk.py checks it.
    """

    def __init__(self, memory: DeviceMemory, cache: OperandCache,
                 gemm: GemmFn = multiply) -> None:
        self.memory, self.cache, self.gemm = memory, cache, gemm
        self.pending: list[ConvTask] = []
        self.tasks_merged = 0

    def submit(self, task: ConvTask) -> None:
        if self.pending and not self._joins(task):
            self.flush()
        if not _cannot_fail_once_mapped(task):
            self.flush()
            execute_conv(self.memory, task, self.cache, self.gemm)
            return
        try:
            check_features(self.memory, task)
            self.cache.check_weights(self.memory, task)
            check_output(self.memory, task)
        except DmaRead:
            self.flush()
            raise
        self.pending.append(task)

    def writes_into(self, start: int, nbytes: int) -> bool:
        """Would the pending tasks write any of [start, start+nbytes)?"""
        if not self.pending:
            return False
        merged = self._merged(self.pending)
        return overlap(extent(start, nbytes), extent(merged.dst_addr, output_span(merged)))

    def flush(self) -> None:
        if not self.pending:
            return
        tasks, self.pending = self.pending, []
        execute_conv(self.memory, self._merged(tasks), self.cache, self.gemm)
        self.tasks_merged += len(tasks) - 1

    @staticmethod
    def _merged(tasks: list[ConvTask]) -> ConvTask:
        if len(tasks) == 1:
            return tasks[0]
        first = tasks[0]
        if tasks[1].weight_key == first.weight_key:      # M tiles
            return replace(first, width=1, height=sum(t.rows for t in tasks),
                           plane_height=first.feature_plane_bytes // limits.ATOM_BYTES)
        return replace(first, kernels=sum(t.kernels for t in tasks),      # N tiles
                       out_channels=sum(t.out_channels for t in tasks),
                       weight_bytes=sum(t.weight_bytes for t in tasks))

    def _joins(self, task: ConvTask) -> bool:
        first = self.pending[0]
        if not (_cannot_fail_once_mapped(task) and task.out_precision == first.out_precision
                and task.dst_plane_bytes == first.dst_plane_bytes):
            return False
        # the batch's kind is set by its second task: M tiles share the first one's weights
        second = self.pending[1] if len(self.pending) > 1 else task
        n_tiles = second.weight_key != first.weight_key
        if not (self._next_n_tile(task) if n_tiles else self._next_m_tile(task)):
            return False
        merged = self._merged([*self.pending, task])
        if merged.rows * limits.ATOM_BYTES > min(merged.feature_plane_bytes, merged.dst_plane_bytes):
            return False
        reads = (extent(merged.feature_addr, feature_span(merged)),
                 extent(merged.weight_addr, merged.weight_bytes))
        writes = extent(merged.dst_addr, output_span(merged))
        if any(overlap(writes, r) for r in reads):
            return False
        try:
            check_features(self.memory, merged)
            check_output(self.memory, merged)
            self.cache.check_weights(self.memory, merged)
        except DmaRead:   # the rows or kernels run across two buffers: keep them apart
            return False
        return True

    def _next_m_tile(self, task: ConvTask) -> bool:
        first, last = self.pending[0], self.pending[-1]
        atom = limits.ATOM_BYTES
        return (task.weight_key == first.weight_key and task.out_channels == first.out_channels
                and task.feature_plane_bytes == first.feature_plane_bytes
                and task.feature_addr == last.feature_addr + last.rows * atom
                and task.dst_addr == last.dst_addr + last.rows * atom)

    def _next_n_tile(self, task: ConvTask) -> bool:
        first, last = self.pending[0], self.pending[-1]
        kernel_bytes = last.channels * np.dtype(NUMPY_DTYPE[last.precision]).itemsize
        return (task.rows == 1 and task.data_key == first.data_key
                and task.kernels >= 2 and first.kernels >= 2   # one kernel alone: numpy's sdot
                and last.kernels == last.out_channels
                and last.kernels % limits.KERNEL_GROUP[last.precision] == 0
                and last.weight_bytes == last.kernels * kernel_bytes
                and task.weight_addr == last.weight_addr + last.weight_bytes
                and task.dst_addr == last.dst_addr
                + last.out_channels // limits.c2(last.out_precision) * last.dst_plane_bytes)
