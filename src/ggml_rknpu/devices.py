"""Opening an NPU device by name: the one place that knows boards and the simulator apart.

Names: ``rknpu`` / ``rocket`` (that driver's node on this machine), ``sim-rknpu`` /
``sim-rocket`` (the simulated kernel driver), a ``/dev`` path, or ``auto`` / None
(``RKNPU_DEVICE`` when set; else every ``/dev/dri/renderD*`` named ``rknpu``, then every
``/dev/accel/accel*`` named ``rocket``, else ``sim-rknpu``). ``RKNPU_TRACE=1`` prints every
syscall, decoded (``kernel/trace.py``); ``RKNPU_SIM_IOVA_BYTES`` shrinks each IOMMU domain of a
simulated vendor driver to that many bytes (``sim/memory.py``).

Invariant: this module sits above ``kernel/`` and ``sim/``; the device it returns only
ever sees a ``Syscalls`` object, and discovers the simulated node exactly as a board's.
"""

from __future__ import annotations

import errno
import os
import warnings
from dataclasses import dataclass

from ggml_rknpu.kernel.device import NODE_PATTERNS, NpuDevice, discover, open_node
from ggml_rknpu.kernel.errors import NpuError
from ggml_rknpu.kernel.syscalls import HostSyscalls, Syscalls
from ggml_rknpu.kernel.trace import from_environment

SIMULATED = ("sim-rknpu", "sim-rocket")
DEVICE_CHOICES = ("rknpu", "rocket", *SIMULATED)


def open_simulated(kind: str, *, kernel: Syscalls | None = None, **options: object) -> NpuDevice:
    """A device over ``kernel`` (a simulated ``kind`` kernel, or a wrapper of one such as
    ``sim.faults.FaultInjector``), by default a fresh ``SimKernel(kind, **options)``."""
    if kernel is None:
        from ggml_rknpu.sim.kernel import SimKernel
        from ggml_rknpu.sim.memory import IOVA_BASE, window_end_from_environment

        end = window_end_from_environment() if kind == "rknpu" else None
        if end is not None:
            options.setdefault("iova_window", (IOVA_BASE, end))
        kernel = SimKernel(kind, **options)  # type: ignore[arg-type]
    elif (abi := getattr(kernel, "abi", kind)) != kind:
        raise NpuError(f"sim-{kind} asked for, but the simulated kernel given is {abi!r}", errno.EINVAL)
    traced = from_environment(kernel)
    nodes = discover(traced)
    return open_node(traced, nodes[0][1], simulated=True)


@dataclass(frozen=True)
class Choice:
    """The device a name resolves to on this machine and why: a board's node (``path``), or the
    simulator (``path`` None; ``unopenable``: the nodes it could not open on the way)."""

    kind: str | None          # rknpu / rocket; None for a /dev path not opened yet
    path: str | None
    why: str
    unopenable: tuple[str, ...] = ()

    @property
    def simulated(self) -> bool:
        return self.path is None


def resolve(name: str | None = None, *, syscalls: Syscalls | None = None) -> Choice:
    """Which device ``open_device(name)`` opens here, and why (see module doc); ``syscalls``
    replaces the host's (tests). A board's node is opened only to read its driver's name."""
    from_env = not name and bool(os.environ.get("RKNPU_DEVICE"))
    name = os.environ["RKNPU_DEVICE"] if from_env else name
    said = f"RKNPU_DEVICE={name}" if from_env else f"{name} asked for"
    if name == "auto":
        name = None
    if name in SIMULATED:
        return Choice(name.removeprefix("sim-"), None, said)
    if name is not None and name.startswith("/"):
        return Choice(None, name, said)
    if name not in (None, "rknpu", "rocket"):
        raise NpuError(f"unknown device {name!r}; choose one of {', '.join(DEVICE_CHOICES)}, auto or a /dev path",
                       errno.EINVAL)
    unopenable: list[str] = []
    host = syscalls or HostSyscalls()
    nodes = [n for n in discover(host, unopenable) if name is None or n[0] == name]
    if nodes:
        kind, path = nodes[0]
        return Choice(kind, path, f"{path} is driven by {kind} ({'found by auto' if name is None else said})")
    if name is None:
        why = (f"could not open {'; '.join(unopenable)} (join the render/video group if one of them is the NPU)"
               if unopenable else f"no {' and no '.join(f'{d}/{p}* named {n}' for d, p, n in NODE_PATTERNS)} "
                                  "on this machine")
        return Choice("rknpu", None, why, tuple(unopenable))
    where = "/dev/dri/renderD* named 'rknpu'" if name == "rknpu" else "/dev/accel/accel* named 'rocket'"
    raise NpuError(f"no {where} found: is the {name} kernel driver loaded and are you in the render/video "
                   f"group? (--device sim-{name} runs the simulator)", errno.ENODEV)


def open_device(name: str | None = None, *, syscalls: Syscalls | None = None) -> NpuDevice:
    """Open ``name`` (see module doc; :func:`resolve` says which device that is). ``syscalls``
    replaces the host's (tests); with a ``sim-*`` name it is the simulated kernel to open (e.g. a
    ``sim.faults.FaultInjector`` around a ``SimKernel``: ``rknpu serve --sim-faults``)."""
    name = name or os.environ.get("RKNPU_DEVICE") or None
    if name in SIMULATED:
        return open_simulated(name.removeprefix("sim-"), kernel=syscalls)
    host = from_environment(syscalls or HostSyscalls())
    choice = resolve(name, syscalls=host)
    if choice.path is not None:
        return open_node(host, choice.path)
    if choice.unopenable:  # maybe an NPU we may not open: say so instead of simulating silently
        warnings.warn(f"using the NPU simulator; {choice.why}", RuntimeWarning, stacklevel=2)
    return open_simulated("rknpu")
