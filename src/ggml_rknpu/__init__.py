"""ggml-rknpu: the Rockchip RK3588 NPU as a compute device for unmodified llama.cpp.

Layers, lowest first, with what each may import: docs/architecture.md.
"""

__version__ = "0.1.0"


def open(device: str | None = None, **kwargs):  # noqa: A001 - mirrors the public API name
    """Open the NPU engine: ``npu = ggml_rknpu.open()``.

    ``device`` is ``"rknpu" | "rocket" | "sim-rknpu" | "sim-rocket"`` or ``None``
    (real hardware when present, else the simulator; ``RKNPU_DEVICE`` overrides).
    """
    from ggml_rknpu.engine import open_engine

    return open_engine(device=device, **kwargs)
