"""ggml-rknpu: the Rockchip RK3588 NPU as a compute device for unmodified llama.cpp.

Layers, lowest first, with what each may import: docs/architecture.md.
"""

__version__ = "0.1.0"


def open(device: str | None = None, **kwargs):  # noqa: A001 - mirrors the public API name
    """Open the NPU engine: ``npu = ggml_rknpu.open()``.

    ``device`` is ``"rknpu" | "rocket" | "sim-rknpu" | "sim-rocket"`` or ``None``
    (real hardware when present, else the simulator; ``RKNPU_DEVICE`` overrides). On
    mainline rocket with more than one core, one open file per core (``engine.open_npu``).
    """
    from ggml_rknpu.engine.core_files import open_npu

    return open_npu(device=device, **kwargs)
