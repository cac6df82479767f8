"""Decoded operands by content: each weight and feature matrix a task reads is decoded to
fp32 once and reused while the memory's content token of its bytes is unchanged.

A host-memory and speed device of the simulator, nothing a board has: docs/simulator.md
"Decoded operands by content"; budgets: docs/memory.md."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable

import numpy as np

from ggml_rknpu.sim.conv import (
    ConvTask,
    check_features,
    extent,
    feature_span,
    overlap,
    read_features,
    read_weights,
    weight_fault,
)
from ggml_rknpu.sim.memory import DeviceMemory, DmaFault, content_token

WEIGHT_CACHE_BYTES = 3 << 30    # decoded fp32 weights kept across runs (gemma3-270m: ~1.1 GiB)
FEATURE_CACHE_BYTES = 256 << 20  # decoded fp32 features (the cores of one submit share A)
# Decoded weights are kept from their second read of the same bytes on: a replayed program
# (every decode token) reads them again, a weight multiplied once (a test case, a MoE expert
# one graph routes to once) is decoded, used and dropped, and costs no host memory after.
SEEN_KEYS = 1 << 16              # weights read once, remembered by key and token
_UNSEEN = object()


class _Decoded:
    """Decoded operands by key, each valid while the memory's content token of its bytes is
    unchanged (``sim.memory.content_token``); least recently used beyond ``max_bytes``.
    An entry with a token needs no address check when the NPU writes: the write bumps the
    token (``note_device_write``). Entries without one are checked by address
    (``invalidate``) and dropped at the end of the run."""

    def __init__(self, max_bytes: int, admit_on_reuse: bool = False) -> None:
        self.max_bytes = max_bytes
        self.admit_on_reuse = admit_on_reuse
        self._entries: OrderedDict[tuple, tuple[object, tuple[int, int], np.ndarray]] = OrderedDict()
        self._untracked: set[tuple] = set()
        self._seen: OrderedDict[tuple, object] = OrderedDict()   # key -> token, read once
        self._bytes = 0

    def get(self, key: tuple, token: object, extent: tuple[int, int],
            read: Callable[[], np.ndarray]) -> np.ndarray:
        hit = self._entries.get(key)
        if hit is not None and hit[0] == token:
            self._entries.move_to_end(key)
            return hit[2]
        value = read()
        if self.admit_on_reuse and token is not None and self._seen.pop(key, _UNSEEN) != token:
            self._drop(key)
            self._seen[key] = token               # kept only if the same bytes are read again
            if len(self._seen) > SEEN_KEYS:
                self._seen.popitem(last=False)
            return value
        self._drop(key)
        self._entries[key] = (token, extent, value)
        if token is None:
            self._untracked.add(key)
        self._bytes += value.nbytes
        self.trim()
        return value

    def trim(self) -> None:
        while self._bytes > self.max_bytes and len(self._entries) > 1:
            self._drop(next(iter(self._entries)))

    def _drop(self, key: tuple) -> None:
        old = self._entries.pop(key, None)
        if old is not None:
            self._bytes -= old[2].nbytes
            self._untracked.discard(key)

    def invalidate(self, start: int, nbytes: int) -> None:
        for key in [k for k in self._untracked if overlap(self._entries[k][1], (start, start + nbytes))]:
            self._drop(key)

    def forget(self, start: int, nbytes: int) -> None:
        """The memory [start, start + nbytes) was freed: drop every entry decoded from it."""
        for key in [k for k, e in self._entries.items() if overlap(e[1], (start, start + nbytes))]:
            self._drop(key)
        for key in [k for k in self._seen if overlap((k[0], k[0] + k[1]), (start, start + nbytes))]:
            del self._seen[key]

    def end_run(self) -> None:
        for key in list(self._untracked):
            self._drop(key)

    def clear(self) -> None:
        self._entries.clear()
        self._untracked.clear()
        self._seen.clear()
        self._bytes = 0


class OperandCache:
    """Decoded (N, C) weights and (M, C) features, so tasks, cores and jobs reading the same
    bytes decode them once: replayed programs skip the weight decode (from the second read
    of the same bytes on: ``SEEN_KEYS``), and the cores of one submit share the decode of A. An entry is keyed by the task's registers and used only
    while the memory's content token of its bytes is unchanged (no sync, no NPU write to
    the object since), so a changed operand is always read again. Entries without a token
    (memory that cannot tell) are dropped when a task writes over them (``invalidate``) and
    at the end of every run."""

    def __init__(self, weight_bytes: int = WEIGHT_CACHE_BYTES,
                 feature_bytes: int = FEATURE_CACHE_BYTES) -> None:
        self._weights = _Decoded(weight_bytes, admit_on_reuse=True)
        self._features = _Decoded(feature_bytes)

    def check_weights(self, memory: DeviceMemory, task: ConvTask) -> object | None:
        """The DMA range check of the task's weights (``weight_fault``); their token."""
        try:
            if not hasattr(memory, "content_token"):
                memory.view(task.weight_addr, task.weight_bytes)
            return content_token(memory, task.weight_addr, task.weight_bytes)
        except DmaFault as fault:
            raise weight_fault(task, fault) from None

    def weights(self, memory: DeviceMemory, task: ConvTask) -> np.ndarray:
        token = self.check_weights(memory, task)
        return self._weights.get(task.weight_key, token, extent(task.weight_addr, task.weight_bytes),
                                 lambda: read_weights(memory, task))

    def features(self, memory: DeviceMemory, task: ConvTask) -> np.ndarray:
        start, nbytes = task.feature_addr, feature_span(task)
        check_features(memory, task)          # the range check (and fault) of read_features
        token = content_token(memory, start, nbytes)
        return self._features.get(task.data_key, token, extent(start, nbytes),
                                  lambda: read_features(memory, task))

    def invalidate(self, start: int, nbytes: int) -> None:
        self._weights.invalidate(start, nbytes)
        self._features.invalidate(start, nbytes)

    def limit_weights(self, max_bytes: int) -> None:
        """Keep at most ``max_bytes`` of decoded weights (least recently used go first)."""
        self._weights.max_bytes = max_bytes
        self._weights.trim()

    def forget(self, start: int, nbytes: int) -> None:
        """The NPU memory [start, start + nbytes) was freed: its decoded copies can never be
        read again (new memory there has a new token), so they go now, not when LRU gets to them."""
        self._weights.forget(start, nbytes)
        self._features.forget(start, nbytes)

    def end_run(self) -> None:
        """Drop what no content token vouches for (it may change before the next run)."""
        self._weights.end_run()
        self._features.end_run()

    def clear(self) -> None:
        self._weights.clear()
        self._features.clear()

