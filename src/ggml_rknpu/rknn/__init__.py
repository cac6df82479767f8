"""Optional second engine over Rockchip's closed librknnrt ``rknn_matmul_api``.

``binding`` is our own ctypes binding (structs from docs/rknn-toolkit.md §4.3, sizes asserted);
``engine.RknnEngine`` has the same interface as ``ggml_rknpu.engine.NpuEngine``. librknnrt.so is not
shipped: install it on the board and/or set ``LIBRKNNRT_PATH``.

Validation status: this engine is validated ONLY through the C stand-in library in
``tests/rknn_standin/`` (built by the tests with gcc), which implements the documented
semantics; it has not run against the real librknnrt until a board reports.
"""

from ggml_rknpu.rknn.binding import RknnError, RknnUnavailable
from ggml_rknpu.rknn.engine import RknnEngine, RknnUnsupportedType

__all__ = ["RknnError", "RknnEngine", "RknnUnavailable", "RknnUnsupportedType"]
