"""PPU + PPU_RDMA: the pooling unit, as far as the vendor's "separator" tasks use it.

The vendor runtime interleaves PPU tasks (op-enable 0x60, int_mask 0xC00, 26-word body)
between conv tasks [capture pw_c256_h14; docs/rknn-toolkit.md §2.2]; decoded with the TRM
they are a 1x1, stride-1 max pool of a small int8 cube read from memory (an identity copy
from SRC_BASE_ADDR to DST_BASE_ADDR). That is what is modeled, at any element width the
RDMA names; anything else is ``NotModeled``. The destination line pitch is taken as the
packed 16*W bytes (an inference: the PPU has no destination line-stride register
[registers.xml]). Field readings: docs/decisions.md "sim/ppu.py"."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from numpy.lib.stride_tricks import as_strided

from ggml_rknpu.hw import limits
from ggml_rknpu.hw.alignment import ceil_div
from ggml_rknpu.sim.conv import DmaRead, DmaWrite
from ggml_rknpu.sim.memory import DeviceMemory, DmaFault, device_write_view
from ggml_rknpu.sim.validate import NotModeled, RegisterSource, check_reserved, fld, refuse

# PPU_RDMA DATA_FORMAT.IN_PRECISION: 0 4-bit, 1 8-bit, 2 16-bit, 3 32-bit [TRM ppu_rdma_data_format]
_RDMA_ELEMENT_BYTES = {1: 1, 2: 2, 3: 4}
_POOL_MAX, _POOL_MIN = 1, 2       # POOLING_METHOD: 0 average, 1 max, 2 min [TRM]
_FROM_MEMORY = 1                  # FLYING_MODE: 0 from DPU, 1 from outside [TRM]


@dataclass(frozen=True)
class PoolTask:
    width: int
    height: int
    channels: int
    element_bytes: int
    src_addr: int
    src_line_bytes: int
    src_plane_bytes: int
    dst_addr: int
    dst_plane_bytes: int


def decode_ppu(regs: RegisterSource, rdma_enabled: bool) -> PoolTask:
    mode = regs.value("PPU_OPERATION_MODE_CFG")
    check_reserved("PPU_OPERATION_MODE_CFG", mode)
    if fld(regs, "PPU_OPERATION_MODE_CFG", "FLYING_MODE") != _FROM_MEMORY:
        raise NotModeled("PPU fed on the fly by the DPU (FLYING_MODE=0)")
    if not rdma_enabled:
        refuse("missing-ppu-rdma", "PPU_OPERATION_MODE_CFG.FLYING_MODE=1 reads the pooling cube "
               "from memory, but the op-enable mask lacks PPU_RDMA (0x40): nothing feeds the "
               "PPU (*inference*; every captured PPU task enables 0x60)",
               "PPU_OPERATION_MODE_CFG", mode)
    method = fld(regs, "PPU_OPERATION_MODE_CFG", "POOLING_METHOD")
    if method not in (_POOL_MAX, _POOL_MIN):
        raise NotModeled(f"PPU POOLING_METHOD={method} (modeled: 1x1 max/min = copy)")
    kernel = regs.value("PPU_POOLING_KERNEL_CFG")
    if kernel or regs.value("PPU_POOLING_PADDING_CFG"):
        raise NotModeled(f"PPU pooling window/padding other than 1x1 (KERNEL_CFG=0x{kernel:X})")
    dims = [fld(regs, f"PPU_DATA_CUBE_IN_{d}", f"CUBE_IN_{d}") + 1
            for d in ("WIDTH", "HEIGHT", "CHANNEL")]
    out = [fld(regs, f"PPU_DATA_CUBE_OUT_{d}", f"CUBE_OUT_{d}") + 1
           for d in ("WIDTH", "HEIGHT", "CHANNEL")]
    rdma = [fld(regs, f"PPU_RDMA_CUBE_IN_{d}", f"CUBE_IN_{d}") + 1
            for d in ("WIDTH", "HEIGHT", "CHANNEL")]
    if out != dims or rdma != dims:
        refuse("ppu-shape", f"a 1x1 stride-1 pool maps cube {dims} to itself, but the output "
               f"cube is {out} and the PPU_RDMA cube is {rdma}", "PPU_DATA_CUBE_OUT_WIDTH",
               regs.value("PPU_DATA_CUBE_OUT_WIDTH"))
    code = fld(regs, "PPU_RDMA_DATA_FORMAT", "IN_PRECISION")
    if code not in _RDMA_ELEMENT_BYTES:
        raise NotModeled(f"PPU_RDMA IN_PRECISION={code} (4-bit elements)")
    return PoolTask(
        width=dims[0], height=dims[1], channels=dims[2], element_bytes=_RDMA_ELEMENT_BYTES[code],
        src_addr=regs.value("PPU_RDMA_SRC_BASE_ADDR"),
        src_line_bytes=fld(regs, "PPU_RDMA_SRC_LINE_STRIDE", "SRC_LINE_STRIDE") * limits.ATOM_BYTES,
        src_plane_bytes=fld(regs, "PPU_RDMA_SRC_SURF_STRIDE", "SRC_SURF_STRIDE") * limits.ATOM_BYTES,
        dst_addr=fld(regs, "PPU_DST_BASE_ADDR", "DST_BASE_ADDR") * limits.ATOM_BYTES,
        dst_plane_bytes=fld(regs, "PPU_DST_SURF_STRIDE", "DST_SURF_STRIDE") * limits.ATOM_BYTES,
    )


def _cube(memory: DeviceMemory, base: int, planes: int, height: int, width: int,
          plane_bytes: int, line_bytes: int, what: str, error: type[DmaRead]) -> np.ndarray:
    atom = limits.ATOM_BYTES
    span = (planes - 1) * plane_bytes + (height - 1) * line_bytes + width * atom
    try:
        flat = device_write_view(memory, base, span) if issubclass(error, DmaWrite) else memory.view(base, span)
    except DmaFault as fault:
        raise error(what, fault) from None
    return as_strided(flat, shape=(planes, height, width * atom),
                      strides=(plane_bytes, line_bytes, 1), writeable=True)


def execute_ppu(memory: DeviceMemory, task: PoolTask) -> None:
    planes = ceil_div(task.channels * task.element_bytes, limits.ATOM_BYTES)
    src = _cube(memory, task.src_addr, planes, task.height, task.width, task.src_plane_bytes,
                task.src_line_bytes, f"pooling input (PPU_RDMA_SRC_BASE_ADDR=0x{task.src_addr:08X})",
                DmaRead)
    data = np.array(src)
    dst = _cube(memory, task.dst_addr, planes, task.height, task.width, task.dst_plane_bytes,
                task.width * limits.ATOM_BYTES,
                f"pooling output (PPU_DST_BASE_ADDR=0x{task.dst_addr:08X})", DmaWrite)
    dst[...] = data
