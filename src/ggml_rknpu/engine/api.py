"""The public matmul engine: resident weights, programs compiled and bound once, then replayed.

    npu = ggml_rknpu.open()                       # or open(device="sim-rocket", cores=3)
    w = npu.upload_weight(b, dtype="fp16")        # b [N, K], ggml layout: one row per output
    c = npu.matmul(a, w)                          # a [M, K], any M -> c [M, N]

Invariants: a weight is converted and packed once into a resident buffer; each (weight, M
bucket) has one program bound to fixed buffers (``engine.programs``); every call is a
``Fusion.run`` (``matmul``: the weight's one-weight fusion), which checks its canaries, so
an unfinished task raises ``StaleOutput`` after a reset; programs stay inside ``envelope``. Why, and scratch, buckets, timing:
docs/decisions.md "engine/api.py"."""

from __future__ import annotations

import errno
from collections.abc import Callable, Sequence
from typing import TypeVar

import numpy as np

from ggml_rknpu.compiler.layout import b_bytes, pack_b
from ggml_rknpu.compiler.shape import MatmulShape
from ggml_rknpu.cost.model import VENDOR_CLOCK, NpuClock
from ggml_rknpu.engine.contract import EngineWeight
from ggml_rknpu.engine.fusion import Fusion, concat_rows
from ggml_rknpu.engine.memory import NpuMemory
from ggml_rknpu.engine.npu_weight import FusedWeight, Weight
from ggml_rknpu.engine.parts import EngineParts
from ggml_rknpu.engine.programs import OUT_FOR_WEIGHT, ProgramCache, out_dtype
from ggml_rknpu.engine.scratch import ScratchPool
from ggml_rknpu.engine.staging import check_matrix, stage_weight
from ggml_rknpu.engine.timing import Timing
from ggml_rknpu.hw.envelope import Envelope, by_name
from ggml_rknpu.kernel.device import NpuDevice
from ggml_rknpu.kernel.errors import NpuError

COUNTERS = ("weights_uploaded", "weight_bytes_uploaded", "weights_freed", "programs_compiled",
            "program_cache_hits", "program_cache_misses", "programs_evicted", "programs_evicted_budget",
            "scratch_grown", "matmuls",
            "submits", "npu_faults", "resets", "fused_weights_uploaded", "fusion_runs", "chained_submits",
            "memory_splits", "weights_past_domain_0")
W = TypeVar("W", bound=Weight)
E = TypeVar("E")



class NpuEngine:
    """The engine over one ``NpuDevice`` (a ``MatmulEngine``); see the module docstring."""

    def __init__(self, device: NpuDevice, cores: int | None = None, envelope: Envelope | str | None = None,
                 counters: dict[str, int] | None = None) -> None:
        """``counters``: a dict of ``COUNTERS`` to count into (the files of one
        ``engine.core_files.CoreFilesEngine`` share theirs), else the engine's own."""
        if cores is not None and not 1 <= cores <= device.n_cores:
            raise ValueError(f"cores must be in 1..{device.n_cores}, got {cores}")
        if envelope is None:
            from ggml_rknpu.engine.envelope_record import recorded_envelope

            envelope = recorded_envelope(device)
        self.envelope = by_name(envelope)
        self.device = device
        # the envelope caps the cores: one until the board's ladder proved more
        self.cores = min(cores or device.n_cores, self.envelope.max_cores)
        self.abi = device.kind
        self.npu_clock = _npu_clock(device)
        self.npu_mhz = None if self.npu_clock is None else self.npu_clock.mhz
        self.counters: dict[str, int] = dict.fromkeys(COUNTERS, 0) if counters is None else counters
        memory = NpuMemory(device)
        self.scratch = ScratchPool(memory, self.counters)
        programs = ProgramCache(device, memory, self.scratch, self.counters, self.cores, self.envelope, self.npu_mhz)
        self.parts = EngineParts(device, memory, programs, self.reset, self.counters)
        self._weights: list[Weight] = []
        self._closed = False

    def describe(self) -> str:
        return f"{self.device.kind} (simulated)" if self.device.simulated else self.device.kind

    @property
    def last_timing(self) -> Timing | None:
        """The last matmul's or fusion's ``Timing``."""
        return self.parts.last_timing

    # -- weights ---------------------------------------------------------------------
    def upload_weight(self, b: np.ndarray, dtype: str = "fp16") -> Weight:
        """Convert ``b`` [N, K] to ``dtype`` ("fp16" | "int8"), pack it into the native
        layout and stage it once in NPU memory; it stays there until ``free()``."""
        return self._upload(b, dtype, Weight)

    def upload_fused_weight(self, parts: list[np.ndarray], dtype: str = "fp16") -> FusedWeight:
        """Sibling weights [N_i, K] (Q/K/V, gate/up: the same input) as one resident weight
        [sum N_i, K]; ``splits`` gives each sibling's output columns, and ``fuse([fused])``
        returns one result per sibling. See ``engine.fusion``."""
        b, splits = concat_rows(parts)
        fused = self._upload(b, dtype, FusedWeight)
        fused.splits = splits
        self.counters["fused_weights_uploaded"] += 1
        return fused

    def fuse(self, weights: Sequence[EngineWeight], m: int = 1, *, out: str | None = None) -> Fusion:
        """A fusion planned once: ``weights`` (one plain or fused weight, or several sharing K
        and dtype, chained in one submit of up to ``m`` rows) applied to one activation.
        ``fusion.run(a, outs)`` -> one array per output. See ``engine.fusion.Fusion``."""
        self._check_open()
        if not weights:
            raise ValueError("a fusion needs at least one weight")
        own = [self._check_weight(w) for w in weights]
        return Fusion(self.parts, own, m, out_dtype(own[0].dtype, out))

    def _upload(self, b: np.ndarray, dtype: str, cls: type[W]) -> W:
        self._check_open()
        staged = stage_weight(b, dtype)
        N, K = staged.shape
        nbytes = b_bytes(MatmulShape(1, K, N, staged.dtype, OUT_FOR_WEIGHT[staged.dtype]))   # independent of M
        memory = self.parts.memory
        several = self.device.max_domains > 1   # placed by the room its programs need, as under a cap
        headroom = self.parts.programs.headroom(N, K, dtype) if memory.cap is not None or several else None
        what = f"weight {N}x{K} {dtype}"
        buffer = (memory.alloc_resident(nbytes, what, headroom) if several
                  else memory.alloc(nbytes, "data", what, resident=True, headroom=headroom))
        try:
            pack_b(staged.data, staged.dtype, out=buffer.array(np.uint8), envelope=self.envelope)   # straight in
            buffer.sync_to_device(0, nbytes)
        except BaseException:
            buffer.close()
            raise
        weight = cls(self, self._forget, staged.without_data(), buffer, nbytes, headroom)
        self._weights.append(weight)
        memory.keep_room(id(weight), headroom, buffer.domain)
        self.counters["weights_past_domain_0"] += buffer.domain > 0
        self.counters["weights_uploaded"] += 1
        self.counters["weight_bytes_uploaded"] += nbytes
        return weight

    def _forget(self, w: Weight) -> None:
        self.parts.programs.forget(w)
        self._weights.remove(w)
        self.parts.memory.drop_room(id(w))
        self.counters["weights_freed"] += 1

    # -- matmul ----------------------------------------------------------------------
    def matmul(self, a: np.ndarray, w: EngineWeight, *, out: str | None = None) -> np.ndarray:
        """``a`` [M, K] times the resident weight -> [M, N]. fp16 weight: float32 (or
        float16 with ``out="fp16"``); int8 weight and int8 ``a``: int32, exact; int8 weight
        and float ``a``: ``a`` quantised per row, float32 out.

        The weight's one-weight fusion (``engine.fusion.Fusion``, kept per output type) into
        a fresh result: rows run through the bound program of their M bucket; more rows than
        the weight's largest program are several runs of it."""
        self._check_open()
        w = self._check_weight(w)
        check_matrix(a, "a")
        N, K = w.shape
        if a.shape[1] != K:
            raise ValueError(f"shape mismatch: a is {a.shape[0]}x{a.shape[1]} but the weight "
                             f"is N={N} x K={K}; a must have K={K} columns")
        out = out_dtype(w.dtype, out)
        if a.dtype != np.int8 and a.dtype.kind != "f":
            raise TypeError(f"activations for a{'n' if w.dtype == 'int8' else ''} {w.dtype} weight must be "
                            f"int8 or float, got {a.dtype}")
        if a.dtype == np.int8 and w.dtype == "fp16":
            a = a.astype(np.float32)            # exact: every int8 is an fp16
        if out == "fp16":
            dtype: type = np.float16
        elif w.dtype == "int8" and a.dtype == np.int8 and w.scales is None:
            dtype = np.int32
        else:
            dtype = np.float32
        result: np.ndarray = np.empty((a.shape[0], N), dtype)
        fusion = w.matmul_fusions.get(out)
        if fusion is None:
            fusion = w.matmul_fusions[out] = Fusion(self.parts, [w], None, out, siblings=False)
        fusion.run(a, [result])
        return result

    def _check_weight(self, w: object) -> Weight:
        """``w`` as this engine's own live ``Weight`` (the contract's handles are any engine's)."""
        if not isinstance(w, Weight) or w.owner is not self:
            raise TypeError("w must be a Weight returned by this NpuEngine's upload_weight")
        if w.freed:
            raise ValueError(f"{w!r} was freed; upload it again")
        return w

    # -- memory ----------------------------------------------------------------------
    @property
    def memory_cap(self) -> int | None:
        """At most this many bytes of NPU memory (None: whatever the driver gives)."""
        return self.parts.memory.cap

    @memory_cap.setter
    def memory_cap(self, cap: int | None) -> None:
        self.parts.memory.cap = cap

    @property
    def program_budget(self) -> int | None:
        """At most this many bytes of bound programs kept (None: bounded by NPU memory only)."""
        return self.parts.programs.max_bytes

    @program_budget.setter
    def program_budget(self, budget: int | None) -> None:
        self.parts.programs.max_bytes = budget
        self.parts.programs.trim()

    @property
    def peak_memory(self) -> int:
        """Most NPU bytes in use at once, tracked while ``memory_cap`` is set."""
        return self.parts.memory.peak

    def memory_budget(self) -> tuple[int, int]:
        """(free, total) bytes of IOMMU domain 0's NPU address space (the device's; ``memory_cap``
        aside); a driver with several domains has as much again in each."""
        return self.device.iova_budget()

    def memory_used(self) -> int:
        """NPU bytes in use: weights, programs, scratch (what ``memory_cap`` bounds)."""
        return self.parts.memory.used()

    def reserve_bytes(self) -> int:
        """What resident memory leaves free under ``memory_cap`` (``NpuMemory.reserve_bytes``)."""
        return self.parts.memory.reserve_bytes()

    def program_bytes(self) -> int:
        """Bytes the cached programs hold: register commands on the device (whole pages, part of
        ``memory_used``) and their compiled words on the host."""
        return self.parts.programs.bytes

    def scratch_bytes(self) -> int:
        """NPU bytes held by the shared A and C buffers."""
        return self.scratch.nbytes()

    # -- faults ----------------------------------------------------------------------
    def reset(self) -> list[Weight]:
        """Reset the NPU after a faulted job; the weights whose NPU copy the reset destroyed.

        Vendor: ACT_RESET (a core that stopped responding needs it). Rocket has no reset
        ioctl and resets a timed-out core itself. Neither reset frees GEM objects (the soft
        reset is of the NPU's blocks, the buffers belong to the open file), so the list is
        empty with both drivers; a caller still re-stages whatever it names."""
        self._check_open()
        try:
            self.device.reset()
        except NpuError as exc:
            if exc.errno != errno.EOPNOTSUPP:   # rocket: the driver already reset the core
                raise
        self.counters["resets"] += 1
        return [w for w in self._weights if w.buffer.closed]

    # -- lifecycle -------------------------------------------------------------------
    def _check_open(self) -> None:
        if self._closed:
            raise ValueError("this NpuEngine is closed")

    def close(self) -> None:
        """Free every weight and program and close the device (idempotent)."""
        if self._closed:
            return
        for w in list(self._weights):
            w.free()
        self.device.close()
        self._closed = True

    def __enter__(self) -> NpuEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _npu_clock(device: NpuDevice) -> NpuClock | None:
    """The NPU clock modeled device time is priced at: the driver's report (vendor GET_FREQ),
    else a simulated kernel's own (sim-rocket's timeline runs at its ``modeled_npu_mhz``), else
    the vendor driver's 1 GHz on the simulator, None (no model) on a board that reports none
    (rocket boots at 200 MHz and is often patched to 600: check-rig reads it)."""
    freq = device.info().npu_freq_hz
    simulated = "simulated " if device.simulated else ""
    if freq:
        return NpuClock(freq / 1e6, f"reported by the {simulated}{device.kind} driver")
    if not device.simulated:
        return None
    modeled = getattr(device.syscalls, "modeled_npu_mhz", None)   # a simulated kernel's own clock
    return NpuClock(modeled, f"the simulated {device.kind} kernel's clock") if modeled else VENDOR_CLOCK


def open_engine(device: str | NpuDevice | None = None, cores: int | None = None,
                envelope: Envelope | str | None = None) -> NpuEngine:
    """The engine on one open file of ``device``: "rknpu" | "rocket" | "sim-rknpu" |
    "sim-rocket" | None (auto; ``RKNPU_DEVICE`` overrides), or an open ``NpuDevice``.
    ``cores`` None: as many as the envelope allows; ``envelope`` None: the recorded one
    (module doc). Mainline rocket runs one file's jobs on one core: ``engine.core_files.open_npu``
    opens a file per core there."""
    return with_device(device, lambda dev: NpuEngine(dev, cores, envelope))


def with_device(device: str | NpuDevice | None, make: Callable[[NpuDevice], E]) -> E:
    """``make`` over ``device`` (an engine over it), opened by name here and closed again if
    ``make`` fails."""
    if device is None or isinstance(device, str):
        from ggml_rknpu.devices import open_device

        dev = open_device(device)
        try:
            return make(dev)
        except BaseException:
            dev.close()
            raise
    return make(device)
