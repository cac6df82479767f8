"""Opening an NPU device by name: the one place that knows boards and the simulator apart.

Names: ``rknpu`` / ``rocket`` (that driver's node on this machine), ``sim-rknpu`` /
``sim-rocket`` (the simulated kernel driver), a ``/dev`` path, or ``auto`` / None
(``RKNPU_DEVICE`` when set; else every ``/dev/dri/renderD*`` named ``rknpu``, then every
``/dev/accel/accel*`` named ``rocket``, else ``sim-rknpu``). ``RKNPU_TRACE=1`` prints every
syscall, decoded (``kernel/trace.py``).

Invariant: this module sits above ``kernel/`` and ``sim/``; the device it returns only
ever sees a ``Syscalls`` object, and discovers the simulated node exactly as a board's.
"""

from __future__ import annotations

import errno
import os
import warnings

from ggml_rknpu.kernel.device import NpuDevice, discover, open_node
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

        kernel = SimKernel(kind, **options)  # type: ignore[arg-type]
    elif (abi := getattr(kernel, "abi", kind)) != kind:
        raise NpuError(f"sim-{kind} asked for, but the simulated kernel given is {abi!r}", errno.EINVAL)
    traced = from_environment(kernel)
    nodes = discover(traced)
    return open_node(traced, nodes[0][1], simulated=True)


def open_device(name: str | None = None, *, syscalls: Syscalls | None = None) -> NpuDevice:
    """Open ``name`` (see module doc). ``syscalls`` replaces the host's (tests); with a
    ``sim-*`` name it is the simulated kernel to open (e.g. a ``sim.faults.FaultInjector``
    around a ``SimKernel``: ``rknpu serve --sim-faults``)."""
    name = name or os.environ.get("RKNPU_DEVICE") or None
    if name == "auto":
        name = None
    if name in SIMULATED:
        return open_simulated(name.removeprefix("sim-"), kernel=syscalls)
    host = from_environment(syscalls or HostSyscalls())
    if name is not None and name.startswith("/"):
        return open_node(host, name)
    if name not in (None, "rknpu", "rocket"):
        raise NpuError(f"unknown device {name!r}; choose one of {', '.join(DEVICE_CHOICES)}, auto or a /dev path",
                       errno.EINVAL)
    unopenable: list[str] = []
    nodes = [n for n in discover(host, unopenable) if name is None or n[0] == name]
    if nodes:
        return open_node(host, nodes[0][1])
    if name is None:
        if unopenable:  # maybe an NPU we may not open: say so instead of simulating silently
            warnings.warn(f"using the NPU simulator; could not open {'; '.join(unopenable)} "
                          "(join the render/video group if one of them is the NPU)", RuntimeWarning, stacklevel=2)
        return open_simulated("rknpu")
    where = "/dev/dri/renderD* named 'rknpu'" if name == "rknpu" else "/dev/accel/accel* named 'rocket'"
    raise NpuError(f"no {where} found: is the {name} kernel driver loaded and are you in the render/video "
                   f"group? (--device sim-{name} runs the simulator)", errno.ENODEV)
