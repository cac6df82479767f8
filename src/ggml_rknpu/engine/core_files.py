"""``CoreFilesEngine``: the engine on mainline rocket with several cores, one open file per core.

Rocket runs one open file's jobs one after another on one core, so a multi-core program from
one file gains nothing. Here each core has its own file: its own ``NpuDevice`` and one-core
``NpuEngine`` (IOMMU domain, scratch, canaries, register commands). A weight is cut by output
rows (whole kernel groups) into a slice per file, so no byte is mapped twice; a matmul or
fusion writes each file's A, arms every file's canaries, launches every file's jobs, then waits
for all of them and reads each file's columns into place. A canary any file left is stale
output. Why: docs/decisions.md "engine/core_files.py"."""

from __future__ import annotations

import errno
import time
import weakref
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from ggml_rknpu.compiler.shape import MatmulShape
from ggml_rknpu.cost.model import ModeledTime, Workload, rocket_files_time
from ggml_rknpu.engine.api import NpuEngine, with_device
from ggml_rknpu.engine.canary import raise_stale
from ggml_rknpu.engine.contract import EngineWeight
from ggml_rknpu.engine.envelope_record import recorded_envelope
from ggml_rknpu.engine.fusion import Fusion, Staged, concat_rows
from ggml_rknpu.engine.npu_weight import Weight
from ggml_rknpu.engine.programs import OUT_FOR_WEIGHT, out_dtype
from ggml_rknpu.engine.staging import WEIGHT_DTYPES, check_matrix
from ggml_rknpu.engine.timing import Timing
from ggml_rknpu.hw.alignment import ceil_div
from ggml_rknpu.hw.envelope import Envelope, by_name
from ggml_rknpu.kernel.device import Launched, NpuDevice, open_node
from ggml_rknpu.kernel.errors import NpuError, NpuTimeout


def row_slices(n: int, k: int, dtype: str, files: int) -> list[tuple[int, int]]:
    """Balanced [n0, n1) ranges of a weight's ``n`` rows, one per file used: whole kernel
    groups (the compiler's N unit), so no slice pads more than the whole weight would; fewer
    ranges than ``files`` when the weight has fewer groups."""
    if dtype not in WEIGHT_DTYPES:
        raise ValueError(f"weight dtype must be one of {WEIGHT_DTYPES}, got {dtype!r}")
    g = MatmulShape(1, k, n, dtype, OUT_FOR_WEIGHT[dtype]).kernel_group
    groups = ceil_div(n, g)
    used = min(files, groups)
    base, extra = divmod(groups, used)
    out, start = [], 0
    for i in range(used):
        end = start + base + (i < extra)
        out.append((start * g, min(end * g, n)))
        start = end
    return out


@dataclass(frozen=True)
class WeightSlice:
    """Rows ``[n0, n1)`` of a weight, resident in file ``file`` as that file's own ``Weight``."""

    file: int
    weight: Weight
    n0: int
    n1: int


class SlicedWeight:
    """A weight resident as one row slice per file (``CoreFilesEngine.upload_weight``); a fused
    one (``upload_fused_weight``) has ``splits``, each sibling's output columns."""

    def __init__(self, owner: CoreFilesEngine, shape: tuple[int, int], dtype: str, slices: tuple[WeightSlice, ...],
                 splits: tuple[tuple[int, int], ...] = ()) -> None:
        self.owner = owner
        self.shape = shape
        self.dtype = dtype
        self.slices = slices
        self.splits = splits
        self.packed_bytes = sum(s.weight.packed_bytes for s in slices)   # the slices: one copy in all
        self.fusions: weakref.WeakSet[CoreFilesFusion] = weakref.WeakSet()
        self.matmul_fusions: dict[str, CoreFilesFusion] = {}
        self.freed = False

    def lost(self) -> bool:
        """Whether a reset destroyed the NPU copy of any slice."""
        return any(s.weight.buffer.closed for s in self.slices)

    def free(self) -> None:
        """Release every slice (and the fusions running it); idempotent."""
        if self.freed:
            return
        for fusion in list(self.fusions):
            fusion.close()
        self.matmul_fusions.clear()
        for s in self.slices:
            s.weight.free()
        self.owner.forget(self)
        self.freed = True

    def __repr__(self) -> str:
        return f"SlicedWeight(N={self.shape[0]}, K={self.shape[1]}, {self.dtype}, {len(self.slices)} files)"


class CoreFilesFusion:
    """``engine.fusion.Fusion`` over the files: one per file holding a slice of ``weights``
    (that file's slices, chained when several), staged and launched on every file before any
    is waited for. ``run`` as ``Fusion.run`` (one result per output; a fused weight gives one
    per sibling)."""

    def __init__(self, owner: CoreFilesEngine, weights: Sequence[SlicedWeight], rows: int | None, out: str, *,
                 siblings: bool = True) -> None:
        if len({(w.shape[1], w.dtype) for w in weights}) != 1:
            raise ValueError("the weights of one fusion must share K and dtype")
        if rows is None and len(weights) > 1:
            raise ValueError("a chained fusion is planned for a number of rows")
        self.owner, self.weights, self.rows, self.out = owner, tuple(weights), rows, out
        self.K, self.dtype = weights[0].shape[1], weights[0].dtype
        self.closed = False
        self.result_dtype: type = np.float32 if self.dtype == "int8" or out == "fp32" else (
            np.float16 if out == "fp16" else np.int32)
        self._direct_dtypes = (np.dtype(self.result_dtype), *((np.dtype(np.int32),) if self.dtype == "int8" else ()))
        self.outputs = [(i, n0, n1) for i, w in enumerate(weights)
                        for n0, n1 in ((siblings and w.splits) or ((0, w.shape[0]),))]
        # per file: (its device, its fusion, (weight index, n0, n1) of each member)
        self.files: list[tuple[NpuDevice, Fusion, tuple[tuple[int, int, int], ...]]] = []
        try:
            for f, engine in enumerate(owner.files):
                mine = [(i, s) for i, w in enumerate(weights) for s in w.slices if s.file == f]
                if mine:
                    fusion = Fusion(engine.parts, [s.weight for _, s in mine], rows, out, siblings=False)
                    self.files.append((engine.device, fusion, tuple((i, s.n0, s.n1) for i, s in mine)))
        except BaseException:
            self.close()
            raise
        self._results: list[np.ndarray] = []
        self.timing: tuple[float, float, float] = (0.0, 0.0, 0.0)   # pack, launch and wait, unpack (measured)
        self._modeled: tuple[tuple[Workload, ...], ModeledTime] | None = None
        for w in weights:
            w.fusions.add(self)

    def run(self, a: np.ndarray, outs: Sequence[np.ndarray] | None = None) -> list[np.ndarray]:
        """``a`` [rows, K] -> one [rows, N_i] result per output, as ``Fusion.run``."""
        t0 = time.perf_counter()
        if self.closed:
            raise ValueError("this fusion was closed (one of its weights was freed); plan it again")
        rows = a.shape[0]
        if self.rows is not None and rows > self.rows:
            raise ValueError(f"activation has shape {a.shape}; this fusion takes [1..{self.rows}, {self.K}]")
        if outs is not None and len(outs) != len(self.outputs):
            raise ValueError(f"this fusion has {len(self.outputs)} outputs, got {len(outs)} arrays")
        direct = outs is not None and self._direct(outs, rows)
        dsts = outs if direct and outs is not None else self._own_results(rows)
        pack_s = submit_s = unpack_s = 0.0
        device_s: float | None = 0.0
        submits = m0 = 0
        while m0 < rows:
            staged = [self._stage(fusion, a, m0, rows - m0) for _, fusion, _ in self.files]
            n = min(s.rows for s in staged)       # each file's program takes at least these rows
            t1 = time.perf_counter()
            for s in staged:
                s.cells.arm()
            launched: list[Launched] = []
            try:
                for (device, _, _), s in zip(self.files, staged):
                    for job in s.jobs:
                        launched.append(device.launch(job))
            finally:     # every launched job is waited for, even when a later launch failed
                self._wait(launched)
            t2 = time.perf_counter()
            unwritten = sum(s.cells.unwritten() for s in staged)
            if unwritten:
                raise_stale(self.owner.counters, self.owner.reset,
                            f"{'; '.join(s.label for s in staged)}: {unwritten} output canaries left unwritten "
                            f"after {len(launched)} job(s) from {len(staged)} files: a task did not finish "
                            "(rocket: job killed at its 500 ms timeout?)")
            for (_, fusion, members), s in zip(self.files, staged):
                fusion.read(s, [dsts[i][:, n0:n1] for i, n0, n1 in members], m0, n)
            t3 = time.perf_counter()
            modeled = self._modeled_time(staged)
            device_s = None if modeled is None or device_s is None else device_s + modeled.total_s
            pack_s, submit_s, unpack_s = pack_s + t1 - t0, submit_s + t2 - t1, unpack_s + t3 - t2
            submits += len(launched)
            m0 += n
            t0 = t3
        if direct and outs is not None:
            results = [o[:rows] for o in outs]
        else:
            results = [self._results[i][:rows, n0:n1] for i, n0, n1 in self.outputs]
            if outs is not None:
                for dst, v in zip(outs, results):
                    np.copyto(dst[:rows], v, casting="same_kind")
                results = [o[:rows] for o in outs]
        unpack_s += time.perf_counter() - t0
        self.timing = (pack_s, submit_s, unpack_s)
        self.owner.ran(self, Timing(pack_s, submit_s, unpack_s, device_s=device_s,
                                    device_label="unknown" if device_s is None else "modeled", submits=submits))
        return results

    def rehearse(self, a: np.ndarray, outs: Sequence[np.ndarray] | None = None) -> float:
        """The host side of ``run`` without a launch (``Fusion.rehearse`` over every file), the
        results into ``outs`` when given: seconds on this host."""
        t0 = time.perf_counter()
        rows = a.shape[0]
        staged = [self._stage(fusion, a, 0, rows) for _, fusion, _ in self.files]
        if min(s.rows for s in staged) < rows:
            raise ValueError(f"rehearse takes the rows of one program; {rows} need several")
        results = self._own_results(rows)
        for (_, fusion, members), s in zip(self.files, staged):
            fusion.read(s, [results[i][:, n0:n1] for i, n0, n1 in members], 0, rows)
        seconds = time.perf_counter() - t0
        for dst, (i, n0, n1) in zip(outs or (), self.outputs):
            np.copyto(dst[:rows], results[i][:rows, n0:n1], casting="same_kind")
        return seconds

    @staticmethod
    def _stage(fusion: Fusion, a: np.ndarray, m0: int, rows: int) -> Staged:
        while True:
            staged = fusion.stage(a, m0, rows)
            if staged is not None:
                return staged

    def _wait(self, launched: list[Launched]) -> None:
        """Wait for every launched job; the first timeout is raised after all were waited for."""
        failed: NpuTimeout | None = None
        for job in launched:
            try:
                job.device.wait(job)
            except NpuTimeout as exc:
                failed = failed or exc
        if failed is not None:
            raise NpuTimeout(f"{self!r} timed out on the NPU: {failed}", failed.errno) from failed

    def _modeled_time(self, staged: list[Staged]) -> ModeledTime | None:
        """The files' jobs side by side (``cost.model.rocket_files_time``), kept for the last
        set of programs; None without an NPU clock."""
        mhz = self.owner.npu_mhz
        if mhz is None:
            return None
        works = tuple(s.workload for s in staged)
        if self._modeled is None or any(x is not y for x, y in zip(self._modeled[0], works)):
            self._modeled = (works, rocket_files_time(works, npu_mhz=mhz))
        return self._modeled[1]

    def _own_results(self, rows: int) -> list[np.ndarray]:
        if not self._results or self._results[0].shape[0] < rows:
            self._results = [np.empty((rows, w.shape[0]), self.result_dtype) for w in self.weights]
        return self._results

    def _direct(self, outs: Sequence[np.ndarray], rows: int) -> bool:
        """Whether ``outs`` take each file's columns straight from C: one output per weight (no
        fused siblings), of the result's type and width."""
        return len(outs) == len(self.weights) and all(
            dst.dtype in self._direct_dtypes and dst.ndim == 2 and dst.shape[0] >= rows and dst.shape[1] == w.shape[0]
            for dst, w in zip(outs, self.weights))

    def close(self) -> None:
        """Release the files' fusions; idempotent."""
        if not self.closed:
            self.closed = True
            for w in self.weights:
                w.fusions.discard(self)
            for _, fusion, _ in self.files:
                fusion.close()

    def __repr__(self) -> str:
        return (f"CoreFilesFusion(M<={self.rows}, K={self.K}, N={'+'.join(str(w.shape[0]) for w in self.weights)}, "
                f"{self.dtype}, {len(self.files)} files)")


class CoreFilesEngine:
    """The engine over one open file per core of a rocket device (a ``MatmulEngine`` and
    ``FusingEngine``; see the module docstring). ``files[0]`` runs on the device it is given,
    the others on files it opens on the same node and closes with it."""

    def __init__(self, device: NpuDevice, cores: int, envelope: Envelope | str | None = None) -> None:
        if device.kind != "rocket":
            raise NpuError(f"a file per core is mainline rocket's way; {device.kind} runs its cores from one file",
                           errno.EINVAL)
        first = NpuEngine(device, 1, envelope)
        if not 2 <= cores <= min(device.n_cores, first.envelope.max_cores):
            first.close()
            raise ValueError(f"cores must be in 2..{min(device.n_cores, first.envelope.max_cores)}, got {cores}")
        self.counters = first.counters          # one set for all files
        self.files: list[NpuEngine] = [first]
        self._weights: list[SlicedWeight] = []
        self._closed = False
        try:
            for _ in range(cores - 1):
                dev = open_node(device.syscalls, device.path, simulated=device.simulated)
                try:
                    self.files.append(NpuEngine(dev, 1, first.envelope, self.counters))
                except BaseException:
                    dev.close()
                    raise
        except BaseException:
            self.close()
            raise
        self.device, self.envelope, self.abi = device, first.envelope, first.abi
        self.npu_clock, self.npu_mhz = first.npu_clock, first.npu_mhz
        self.cores = cores
        self.last_timing: Timing | None = None

    def describe(self) -> str:
        return f"{self.files[0].describe()}, a file per core ({self.cores})"

    # -- weights ---------------------------------------------------------------------
    def upload_weight(self, b: np.ndarray, dtype: str = "fp16") -> SlicedWeight:
        """``b`` [N, K] as one row slice per file (``NpuEngine.upload_weight`` each)."""
        return self._upload(b, dtype, ())

    def upload_fused_weight(self, parts: list[np.ndarray], dtype: str = "fp16") -> SlicedWeight:
        """Sibling weights [N_i, K] as one sliced weight; ``splits`` gives each sibling's columns."""
        b, splits = concat_rows(parts)
        fused = self._upload(b, dtype, splits)
        self.counters["fused_weights_uploaded"] += 1
        return fused

    def _upload(self, b: np.ndarray, dtype: str, splits: tuple[tuple[int, int], ...]) -> SlicedWeight:
        self._check_open()
        check_matrix(b, "weight")
        N, K = b.shape
        ranges = row_slices(N, K, dtype, len(self.files))
        # fewer slices than files (a narrow weight): the files holding least take them
        files = sorted(sorted(range(len(self.files)), key=lambda f: self.files[f].memory_used())[: len(ranges)])
        slices: list[WeightSlice] = []
        try:
            for f, (n0, n1) in zip(files, ranges):
                slices.append(WeightSlice(f, self.files[f].upload_weight(b[n0:n1], dtype), n0, n1))
        except BaseException:
            for s in slices:
                s.weight.free()
            raise
        self.counters["weights_uploaded"] -= len(slices) - 1        # one weight, however many slices
        weight = SlicedWeight(self, (N, K), dtype, tuple(slices), splits)
        self._weights.append(weight)
        return weight

    def forget(self, w: SlicedWeight) -> None:
        """``w`` was freed (its slices count as one weight freed)."""
        self._weights.remove(w)
        self.counters["weights_freed"] -= len(w.slices) - 1

    def _check_weight(self, w: object) -> SlicedWeight:
        if not isinstance(w, SlicedWeight) or w.owner is not self:
            raise TypeError("w must be a weight returned by this engine's upload_weight")
        if w.freed:
            raise ValueError(f"{w!r} was freed; upload it again")
        return w

    # -- runs ------------------------------------------------------------------------
    def fuse(self, weights: Sequence[EngineWeight], m: int = 1, *, out: str | None = None) -> CoreFilesFusion:
        """As ``NpuEngine.fuse``: ``weights`` applied to one activation of up to ``m`` rows."""
        self._check_open()
        if not weights:
            raise ValueError("a fusion needs at least one weight")
        own = [self._check_weight(w) for w in weights]
        return CoreFilesFusion(self, own, m, out_dtype(own[0].dtype, out))

    def matmul(self, a: np.ndarray, w: EngineWeight, *, out: str | None = None) -> np.ndarray:
        """As ``NpuEngine.matmul``: ``a`` [M, K] times the weight -> [M, N]."""
        self._check_open()
        own = self._check_weight(w)
        check_matrix(a, "a")
        N, K = own.shape
        if a.shape[1] != K:
            raise ValueError(f"shape mismatch: a is {a.shape[0]}x{a.shape[1]} but the weight is N={N} x K={K}; "
                             f"a must have K={K} columns")
        kind = out_dtype(own.dtype, out)
        if a.dtype != np.int8 and a.dtype.kind != "f":
            raise TypeError(f"activations for a {own.dtype} weight must be int8 or float, got {a.dtype}")
        if a.dtype == np.int8 and own.dtype == "fp16":
            a = a.astype(np.float32)            # exact: every int8 is an fp16
        scaled = any(s.weight.scales is not None for s in own.slices)
        dtype: type = (np.float16 if kind == "fp16" else
                       np.int32 if own.dtype == "int8" and a.dtype == np.int8 and not scaled else np.float32)
        result: np.ndarray = np.empty((a.shape[0], N), dtype)
        fusion = own.matmul_fusions.get(kind)
        if fusion is None:
            fusion = own.matmul_fusions[kind] = CoreFilesFusion(self, [own], None, kind, siblings=False)
        fusion.run(a, [result])
        return result

    def ran(self, fusion: CoreFilesFusion, timing: Timing) -> None:
        """A fusion's run ended: its timing and the engine's counters."""
        self.last_timing = timing
        c = self.counters
        c["submits"] += timing.submits
        c["matmuls"] += len(fusion.weights)
        c["fusion_runs"] += 1
        c["chained_submits"] += len(fusion.weights) > 1

    # -- memory ----------------------------------------------------------------------
    @property
    def memory_cap(self) -> int | None:
        """At most this many NPU bytes over all files (each file gets an equal share)."""
        caps = [f.memory_cap for f in self.files]
        return None if caps[0] is None else sum(c or 0 for c in caps)

    @memory_cap.setter
    def memory_cap(self, cap: int | None) -> None:
        for f in self.files:
            f.memory_cap = None if cap is None else cap // len(self.files)

    @property
    def program_budget(self) -> int | None:
        """At most this many bytes of bound programs over all files (an equal share each)."""
        budgets = [f.program_budget for f in self.files]
        return None if budgets[0] is None else sum(b or 0 for b in budgets)

    @program_budget.setter
    def program_budget(self, budget: int | None) -> None:
        for f in self.files:
            f.program_budget = None if budget is None else budget // len(self.files)

    @property
    def peak_memory(self) -> int:
        """The files' peaks added (an upper bound of the peak of their sum)."""
        return sum(f.peak_memory for f in self.files)

    def memory_budget(self) -> tuple[int, int]:
        """(free, total) bytes of the files' NPU address spaces added (one domain each)."""
        budgets = [f.memory_budget() for f in self.files]
        return sum(b[0] for b in budgets), sum(b[1] for b in budgets)

    def memory_used(self) -> int:
        """NPU bytes in use in all files: weight slices, programs, scratch."""
        return sum(f.memory_used() for f in self.files)

    def reserve_bytes(self) -> int:
        return sum(f.reserve_bytes() for f in self.files)

    def scratch_bytes(self) -> int:
        return sum(f.scratch_bytes() for f in self.files)

    # -- faults and lifecycle --------------------------------------------------------
    def reset(self) -> list[SlicedWeight]:
        """Reset after a faulted run (``NpuEngine.reset`` of every file, counted once): the
        weights a slice of which the reset destroyed."""
        self._check_open()
        for f in self.files:
            f.reset()
        self.counters["resets"] -= len(self.files) - 1
        return [w for w in self._weights if w.lost()]

    def _check_open(self) -> None:
        if self._closed:
            raise ValueError("this engine is closed")

    def close(self) -> None:
        """Free every weight and close every file (idempotent)."""
        if self._closed:
            return
        self._closed = True
        for w in list(self._weights):
            w.free()
        for f in self.files:
            f.close()

    def __enter__(self) -> CoreFilesEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def open_npu(device: str | NpuDevice | None = None, cores: int | None = None,
             envelope: Envelope | str | None = None) -> NpuEngine | CoreFilesEngine:
    """As ``engine.api.open_engine``, but on mainline rocket with more than one core (after the
    envelope's cap) a ``CoreFilesEngine``, a file per core (``ggml_rknpu.open``, ``rknpu serve``)."""
    return with_device(device, lambda dev: _engine(dev, cores, envelope))


def _engine(device: NpuDevice, cores: int | None, envelope: Envelope | str | None) -> NpuEngine | CoreFilesEngine:
    """``open_npu``'s engine on ``device`` (out-of-range ``cores`` refused by ``NpuEngine``)."""
    if device.kind == "rocket" and (cores is None or 1 < cores <= device.n_cores):
        env = recorded_envelope(device) if envelope is None else by_name(envelope)
        used = min(cores or device.n_cores, env.max_cores)
        if used > 1:
            return CoreFilesEngine(device, used, env)
    return NpuEngine(device, cores, envelope)
