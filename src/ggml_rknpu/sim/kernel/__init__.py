"""The vendor ``rknpu`` and mainline ``rocket`` kernel drivers in software, behind ``Syscalls``.

Invariants: each receives exactly what the real kernel receives (request numbers and struct
bytes) and answers the way the real driver does [docs/npu-programming.md §3-§5]; cached
objects move data between CPU and device copies only through MEM_SYNC / FINI_BO / PREP_BO;
``hw_elapse_time`` stays 0 (no hardware clock). ``common.py`` is what both share,
``rknpu.py`` and ``rocket.py`` mirror ``kernel/rknpu/`` and ``kernel/rocket/``.
What is modelled and the sources: docs/decisions.md "sim/kernel", docs/envelope.md."""

from ggml_rknpu.sim.kernel.common import DMESG_LINES, NpuModel, SimKernel
from ggml_rknpu.sim.kernel.rknpu import SimRknpuKernel, fuzz_status
from ggml_rknpu.sim.kernel.rocket import SimRocketKernel

__all__ = ["DMESG_LINES", "NpuModel", "SimKernel", "SimRknpuKernel", "SimRocketKernel", "fuzz_status"]
