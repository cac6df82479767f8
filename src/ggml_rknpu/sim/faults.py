"""Fault injection for the simulated NPU: a ``Syscalls`` wrapper around ``SimKernel``.

``rknpu serve --sim-faults SPEC`` (and tests) decide per SUBMIT whether a job runs or fails
the way a board's NPU fails: ``timeout``, ``dma``, ``stale`` or ``core``, at a seeded rate
(``timeout:0.02``) or on a schedule (``dma@3``), ``seed=N``. Invariants: it sits at the
kernel boundary, so everything above runs the code it runs on a board and ``sim/kernel/``
is untouched; at most one fault a submit; a faulted job never runs, so its outputs are not
written; ``counts`` and ``resets`` say what was injected and seen. Each kind's symptom per
ABI: docs/faults.md "Injecting faults"."""

from __future__ import annotations

import ctypes
import errno
import random
import re
from dataclasses import dataclass, field
from typing import Any

from ggml_rknpu.kernel import drm
from ggml_rknpu.kernel.rknpu import uapi as rk
from ggml_rknpu.kernel.rocket import uapi as ro

KINDS = ("timeout", "dma", "stale", "core")
# the IOVA an injected DMA fault names in its dmesg line: page 0, which no buffer is ever mapped at
DMA_FAULT_IOVA = 0x0
_RATE = re.compile(r"^(?P<kind>[a-z]+):(?P<rate>[0-9.eE+-]+)$")
_AT = re.compile(r"^(?P<kind>[a-z]+)@(?P<n>[0-9]+)$")
_SEED = re.compile(r"^seed=(?P<seed>-?[0-9]+)$")


class FaultSpecError(ValueError):
    """A --sim-faults SPEC that does not parse; the message shows the grammar."""


@dataclass(frozen=True)
class FaultSpec:
    """Parsed SPEC: per-kind rates, a schedule (submit number -> kind) and the seed."""

    rates: tuple[tuple[str, float], ...] = ()
    schedule: tuple[tuple[int, str], ...] = ()
    seed: int = 0

    @classmethod
    def parse(cls, text: str) -> FaultSpec:
        rates: dict[str, float] = {}
        schedule: dict[int, str] = {}
        seed = 0
        for item in (part.strip() for part in text.split(",")):
            if not item:
                continue
            if m := _SEED.match(item):
                seed = int(m["seed"])
                continue
            m = _RATE.match(item) or _AT.match(item)
            if m is None:
                raise FaultSpecError(f"--sim-faults item {item!r}: expected KIND:RATE, KIND@N or seed=S "
                                     f"(KIND one of {', '.join(KINDS)}), e.g. 'timeout:0.02,stale@5,seed=1'")
            kind = m["kind"]
            if kind not in KINDS:
                raise FaultSpecError(f"--sim-faults item {item!r}: unknown fault kind {kind!r}; "
                                     f"kinds are {', '.join(KINDS)}")
            if "rate" in m.groupdict():
                try:
                    rate = float(m["rate"])
                except ValueError:
                    raise FaultSpecError(f"--sim-faults item {item!r}: {m['rate']!r} is not a number") from None
                if not 0.0 <= rate <= 1.0:
                    raise FaultSpecError(f"--sim-faults item {item!r}: a rate is a probability per submit, "
                                         "0..1")
                rates[kind] = rate
            else:
                n = int(m["n"])
                if n < 1:
                    raise FaultSpecError(f"--sim-faults item {item!r}: submits are numbered from 1")
                if n in schedule:
                    raise FaultSpecError(f"--sim-faults: submit {n} is scheduled twice "
                                         f"({schedule[n]} and {kind})")
                schedule[n] = kind
        if sum(rates.values()) > 1.0:
            raise FaultSpecError(f"--sim-faults: the rates add up to {sum(rates.values()):g} > 1 (at most one "
                                 "fault per submit)")
        return cls(tuple(rates.items()), tuple(sorted(schedule.items())), seed)

    def describe(self) -> str:
        parts = [f"{k} {r:g}/submit" for k, r in self.rates]
        parts += [f"{k} at submit {n}" for n, k in self.schedule]
        return (", ".join(parts) or "none") + f" (seed {self.seed})"


@dataclass
class FaultInjector:
    """``Syscalls`` that forwards to ``inner`` (a ``SimKernel``) and fails SUBMITs per ``spec``."""

    inner: Any
    spec: FaultSpec
    counts: dict[str, int] = field(default_factory=lambda: dict.fromkeys(KINDS, 0))
    submits: int = 0
    resets: int = 0
    hung: bool = False
    dead_cores: set[int] = field(default_factory=set)
    _failed_outputs: dict[int, str] = field(default_factory=dict)   # rocket: BO handle -> why
    _rng: random.Random = field(init=False)
    _schedule: dict[int, str] = field(init=False)

    def __post_init__(self) -> None:
        self._rng = random.Random(self.spec.seed)
        self._schedule = dict(self.spec.schedule)
        self._nr = {"submit": drm.DRM_COMMAND_BASE + int(rk.Nr.SUBMIT if self.abi == "rknpu" else ro.Nr.SUBMIT),
                    "action": drm.DRM_COMMAND_BASE + int(rk.Nr.ACTION),
                    "prep": drm.DRM_COMMAND_BASE + int(ro.Nr.PREP_BO)}

    def __getattr__(self, name: str) -> Any:   # n_cores, iova_budget, stats, dmesg... of the kernel
        return getattr(self.inner, name)

    def ioctl(self, fd: int, request: int, arg: bytearray) -> int:
        nr = drm.decode_request(request).nr
        if nr == self._nr["submit"]:
            return self._submit(fd, request, arg)
        if self.abi == "rknpu" and nr == self._nr["action"]:
            action = rk.rknpu_action.from_buffer_copy(bytes(arg[:ctypes.sizeof(rk.rknpu_action)]))
            if action.flags == rk.Action.ACT_RESET:
                self.resets += 1
                self.hung = False
                self.dead_cores.clear()
        if self.abi == "rocket" and nr == self._nr["prep"]:
            handle = ro.drm_rocket_prep_bo.from_buffer_copy(bytes(arg[:ctypes.sizeof(ro.drm_rocket_prep_bo)])).handle
            why = self._failed_outputs.pop(handle, None)
            self.inner.ioctl(fd, request, arg)
            if why is not None and self.inner.rocket_errors == "loud":
                raise OSError(errno.ETIMEDOUT, f"PREP_BO: the job writing this BO failed: {why}")
            return 0
        return self.inner.ioctl(fd, request, arg)

    # ------------------------------------------------------------------ the decision
    def _draw(self) -> str | None:
        self.submits += 1
        kind = self._schedule.get(self.submits)
        if kind is not None or not self.spec.rates:
            return kind
        u = self._rng.random()
        for k, rate in self.spec.rates:
            if u < rate:
                return k
            u -= rate
        return None

    def _submit(self, fd: int, request: int, arg: bytearray) -> int:
        if self.abi == "rknpu":
            return self._rk_submit(fd, request, arg)
        return self._ro_submit(fd, request, arg)

    def _rk_submit(self, fd: int, request: int, arg: bytearray) -> int:
        struct = rk.submit_struct_for(self.inner.driver_version)
        s = struct.from_buffer_copy(bytes(arg[:ctypes.sizeof(struct)]).ljust(ctypes.sizeof(struct), b"\0"))
        mask = s.core_mask & rk.CORE_MASK_ALL
        cores = [c for c in range(self.inner.n_cores) if mask >> c & 1] or [0]
        kind = self._draw()
        if kind == "core":
            self.dead_cores.add(self._rng.choice(cores))
        elif kind == "timeout":
            self.hung = True
        if kind is not None:
            self.counts[kind] += 1
        if self.hung or self.dead_cores & set(cores):
            why = "the NPU hangs" if self.hung else f"core {min(self.dead_cores & set(cores))} does not respond"
            self.inner.log_line(f"RKNPU: injected fault: {why} until ACT_RESET")
            raise OSError(errno.ETIMEDOUT, f"SUBMIT: job timeout after {s.timeout} ms (injected fault: {why} "
                                           "until reset; simulated time)")
        if kind == "dma":
            # the vendor driver knows only timeouts: the IOMMU reports the page fault in dmesg, the
            # job never raises its interrupt, rknpu_job_wait gives ETIMEDOUT and rknpu_job_abort
            # soft-resets the NPU, so the next job runs [docs/npu-programming.md "What the drivers really do"]
            self.inner.log_line(f"rk_iommu: Page fault at {DMA_FAULT_IOVA:#x} of type read (injected fault)")
            self.inner.log_line(f"RKNPU: job timeout after {s.timeout} ms; soft reset")
            raise OSError(errno.ETIMEDOUT, f"SUBMIT: job timeout after {s.timeout} ms (injected NPU DMA fault: an "
                                           "IOMMU page fault in dmesg; the driver soft-reset the NPU; simulated "
                                           "time)")
        if kind == "stale":
            s.task_counter = s.task_number   # "completed"; C was never written
            if hasattr(s, "hw_elapse_time"):
                s.hw_elapse_time = 0
            arg[:ctypes.sizeof(struct)] = bytes(s)[:len(arg)]
            return 0
        return self.inner.ioctl(fd, request, arg)

    def _ro_submit(self, fd: int, request: int, arg: bytearray) -> int:
        kind = self._draw()
        if kind is None:
            return self.inner.ioctl(fd, request, arg)
        self.counts[kind] += 1
        if kind == "stale":
            return 0   # mainline PREP_BO then returns 0 with the old bytes: nothing tells the caller
        s = ro.drm_rocket_submit.from_buffer_copy(bytes(arg[:ctypes.sizeof(ro.drm_rocket_submit)]))
        why = {"timeout": "the core hung (injected); rocket reset it after its job timeout",
               "dma": "NPU DMA fault (injected): an IOMMU page fault in dmesg, then the job timeout and a "
                      "core reset",
               "core": "a core stopped responding (injected); rocket reset it after its job timeout"}[kind]
        for i in range(s.job_count):
            job = ro.drm_rocket_job.from_buffer_copy(ctypes.string_at(s.jobs + i * s.job_struct_size,
                                                                      ctypes.sizeof(ro.drm_rocket_job)))
            if job.out_bo_handle_count:
                handles = (ctypes.c_uint32 * job.out_bo_handle_count).from_buffer_copy(
                    ctypes.string_at(job.out_bo_handles, 4 * job.out_bo_handle_count))
                for h in handles:
                    self._failed_outputs[h] = why
        self.inner.log_line(f"ROCKET: injected fault: {why}")
        return 0


def inject_faults(kind: str, spec: FaultSpec | str, **kernel_options: Any) -> FaultInjector:
    """A ``FaultInjector`` per ``spec`` around a fresh simulated ``kind`` ("rknpu" | "rocket")
    kernel (``kernel_options``: ``SimKernel``'s). Open a device on it through the opener,
    ``devices.open_device(f"sim-{kind}", syscalls=injector)``: the device only ever sees
    ``Syscalls``."""
    from ggml_rknpu.sim.kernel import SimKernel

    return FaultInjector(SimKernel(kind, **kernel_options), FaultSpec.parse(spec) if isinstance(spec, str) else spec)
