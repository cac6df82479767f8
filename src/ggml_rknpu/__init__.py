"""ggml-rknpu: the Rockchip RK3588 NPU as a compute device for unmodified llama.cpp.

Layers, lowest first, with what each may import: docs/architecture.md.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:   # the engine loads on the first open()
    from ggml_rknpu.hw.envelope import Envelope
    from ggml_rknpu.kernel.device import NpuDevice

__version__ = "0.1.0"


def open(device: str | NpuDevice | None = None, cores: int | None = None,  # noqa: A001 - mirrors the public API name
         envelope: Envelope | str | None = None):
    """Open the NPU engine: ``npu = ggml_rknpu.open()``.

    ``device`` is ``"rknpu" | "rocket" | "sim-rknpu" | "sim-rocket"`` or ``None``
    (real hardware when present, else the simulator; ``RKNPU_DEVICE`` overrides), or an
    open ``NpuDevice``.
    """
    from ggml_rknpu.engine import open_engine

    return open_engine(device=device, cores=cores, envelope=envelope)
