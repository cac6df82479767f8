"""Register values of one matmul task, by name, following the single-task recipe
[docs/npu-programming.md §7].

Invariants: every task writes the full register set the hardware-validated golden streams
write (104 body words, same registers, same order), never relying on a value left by an
earlier task (ping-pong inheritance, §2); every value is built from named fields through
``hw.registers``, no shifts here; a tile of a larger matmul keeps the full-M plane
pitches. The choices where the golden streams and the vendor differ, with sources:
docs/compiler.md "Register values"."""

from __future__ import annotations

from ggml_rknpu.compiler.shape import MatmulShape
from ggml_rknpu.compiler.tiling import FEATURE_GRAINS_EXTRA, TaskTile
from ggml_rknpu.hw import limits
from ggml_rknpu.hw.alignment import ceil_div
from ggml_rknpu.hw.registers import REGISTERS

R = REGISTERS

# Registers holding a buffer address, and which buffer: bound by Program.bind().
ADDRESS_ROLES: dict[str, str] = {
    "CNA_FEATURE_DATA_ADDR": "A",
    "CNA_DCOMP_ADDR0": "B",
    "DPU_DST_BASE_ADDR": "C",
}

PP_POINTER = R["DPU_S_POINTER"].encode(POINTER_PP_EN=1, EXECUTER_PP_EN=1, POINTER_PP_MODE=1)  # 0xE [§2]
BURST_LEN = 15               # DMA_CON0 / FEATURE_MODE_CFG burst length [§7]
OUTPUT_MODE_MEMORY = 2       # DPU FEATURE_MODE_CFG.OUTPUT_MODE: to memory [§7]
LINE_STRIDE_PER_W = 4        # LINE_STRIDE = 4*W [§7 field notes]
DATA_ENTRY_BYTES = 64        # DATA_ENTRIES = ceil(W*Kc*b / 64) [§7; MESA and AB agree]
_LUT_REGISTERS = tuple(        # DPU 0x4100..0x412C, all written 0 [§2, §7]
    sorted((n for n in REGISTERS if n.startswith("DPU_LUT_")), key=lambda n: REGISTERS[n].offset)
)


def twos_complement(value: int, bits: int) -> int:
    """``value`` as a ``bits``-wide two's-complement field (SURF_STRIDE may be negative:
    H=1 gives 0x0FFFFFFD [§7])."""
    if not -(1 << (bits - 1)) <= value < (1 << (bits - 1)):
        raise ValueError(f"{value} does not fit a signed {bits}-bit field")
    return value & ((1 << bits) - 1)


def ow_size_e(shape: MatmulShape, c_dtype: str) -> int:
    """S - 1 with S = kernel group x output bytes / 16 (fp16->fp32 4, fp16->fp16 2,
    int8->int32 8) -- a fit to every MTX/MESA/blob value, not a documented rule [§7]."""
    return shape.kernel_group * limits.BYTES[c_dtype] // limits.ATOM_BYTES - 1


def buffer_offsets(shape: MatmulShape, tile: TaskTile, c_dtype: str) -> dict[str, int]:
    """Byte offsets of the task's first A/B/C element inside the native buffers (layout.py).
    B: the task's kernel group inside its weight chunk ``(Np/g, Kc/32, g, 32)``, then its
    first channel inside the group's run (non-zero only for a one-group task of part of
    the chunk, ``tiling.group_split``)."""
    b = shape.in_bytes
    atom = limits.ATOM_BYTES
    c2_out = limits.c2(c_dtype)
    c_region = (shape.Np // c2_out) * shape.M * atom
    block = tile.block or tile.chunk
    return {
        "A": (tile.chunk.k0 // shape.c2_in) * shape.M * atom + tile.m0 * atom,
        "B": (shape.Np * block.k0 * b + tile.n0 * block.size * b
              + (tile.chunk.k0 - block.k0) * shape.kernel_group * b),
        "C": tile.chunk.index * c_region + (tile.n0 // c2_out) * shape.M * atom + tile.m0 * atom,
    }


def task_registers(shape: MatmulShape, tile: TaskTile, c_dtype: str) -> list[tuple[str, int]]:
    """(register name, value) for every body register of one task, in MTX order.
    Address registers carry the byte offset inside their buffer (see ADDRESS_ROLES)."""
    b = shape.in_bytes
    kc = tile.chunk.size
    rows, kernels = tile.m, tile.n
    width = 1                                            # W = 1: M runs along H [§6]
    prec = limits.CNA_PRECISION[shape.dtype]
    dpu_in = limits.DPU_PRECISION[shape.dtype]
    dpu_out = limits.DPU_PRECISION[c_dtype]
    size_e = ow_size_e(shape, c_dtype)
    offsets = buffer_offsets(shape, tile, c_dtype)
    surf_stride = twos_complement(width * (shape.M - 4), R["CNA_DMA_CON2"].field("SURF_STRIDE").width)

    regs: list[tuple[str, int]] = [
        ("DPU_S_POINTER", PP_POINTER),
        ("CNA_CONV_CON1", R["CNA_CONV_CON1"].encode(PROC_PRECISION=prec, IN_PRECISION=prec, CONV_MODE=0)),
        ("CNA_CONV_CON2", R["CNA_CONV_CON2"].encode(FEATURE_GRAINS=rows + FEATURE_GRAINS_EXTRA, KERNEL_GROUP=0)),
        ("CNA_CONV_CON3", R["CNA_CONV_CON3"].encode(CONV_X_STRIDE=1, CONV_Y_STRIDE=1, NN_MODE=0)),
        ("CNA_DATA_SIZE0", R["CNA_DATA_SIZE0"].encode(DATAIN_WIDTH=width, DATAIN_HEIGHT=rows)),
        ("CNA_DATA_SIZE1", R["CNA_DATA_SIZE1"].encode(DATAIN_CHANNEL_REAL=kc - 1, DATAIN_CHANNEL=kc)),
        ("CNA_DATA_SIZE2", R["CNA_DATA_SIZE2"].encode(DATAOUT_WIDTH=width)),
        ("CNA_DATA_SIZE3", R["CNA_DATA_SIZE3"].encode(DATAOUT_ATOMICS=width * rows)),
        ("CNA_WEIGHT_SIZE0", R["CNA_WEIGHT_SIZE0"].encode(WEIGHT_BYTES=kc * b * kernels)),
        ("CNA_WEIGHT_SIZE1", R["CNA_WEIGHT_SIZE1"].encode(WEIGHT_BYTES_PER_KERNEL=kc * b)),
        ("CNA_WEIGHT_SIZE2", R["CNA_WEIGHT_SIZE2"].encode(WEIGHT_WIDTH=1, WEIGHT_HEIGHT=1, WEIGHT_KERNELS=kernels)),
        ("CNA_CBUF_CON0", R["CNA_CBUF_CON0"].encode(DATA_BANK=tile.data_banks, WEIGHT_BANK=tile.weight_banks)),
        ("CNA_CBUF_CON1", R["CNA_CBUF_CON1"].encode(DATA_ENTRIES=ceil_div(width * kc * b, DATA_ENTRY_BYTES))),
        ("CNA_CVT_CON0", R["CNA_CVT_CON0"].encode(DATA_SIGN=1, CVT_TYPE=1, CVT_BYPASS=1)),
        ("CNA_CVT_CON1", R["CNA_CVT_CON1"].encode(CVT_SCALE0=1)),
        ("CNA_CVT_CON2", R["CNA_CVT_CON2"].encode(CVT_SCALE1=1)),
        ("CNA_CVT_CON3", R["CNA_CVT_CON3"].encode(CVT_SCALE2=1)),
        ("CNA_CVT_CON4", R["CNA_CVT_CON4"].encode(CVT_SCALE3=1)),
        ("CNA_FC_CON0", 0),
        ("CNA_FC_CON1", 0),
        ("CNA_PAD_CON0", 0),
        ("CNA_FEATURE_DATA_ADDR", offsets["A"]),
        ("CNA_FC_CON2", 0),
        ("CNA_DMA_CON0", R["CNA_DMA_CON0"].encode(WEIGHT_BURST_LEN=BURST_LEN, DATA_BURST_LEN=BURST_LEN)),
        ("CNA_DMA_CON1", R["CNA_DMA_CON1"].encode(LINE_STRIDE=LINE_STRIDE_PER_W * width)),
        ("CNA_DMA_CON2", R["CNA_DMA_CON2"].encode(SURF_STRIDE=surf_stride)),
        ("CNA_FC_DATA_SIZE0", R["CNA_FC_DATA_SIZE0"].encode(DMA_WIDTH=width, DMA_HEIGHT=rows)),
        ("CNA_FC_DATA_SIZE1", R["CNA_FC_DATA_SIZE1"].encode(DMA_CHANNEL=kc)),
        ("CNA_DCOMP_CTRL", 0),
        ("CNA_DCOMP_REGNUM", 0),
        ("CNA_DCOMP_ADDR0", offsets["B"]),
        *[(f"CNA_DCOMP_AMOUNT{i}", 0) for i in range(16)],
        ("CNA_CVT_CON5", 0),
        ("CNA_PAD_CON1", 0),
        ("CORE_MISC_CFG", R["CORE_MISC_CFG"].encode(PROC_PRECISION=prec, QD_EN=1 if shape.dtype == "fp16" else 0)),
        ("CORE_DATAOUT_SIZE_0", R["CORE_DATAOUT_SIZE_0"].encode(DATAOUT_HEIGHT=rows - 1, DATAOUT_WIDTH=width - 1)),
        ("CORE_DATAOUT_SIZE_1", R["CORE_DATAOUT_SIZE_1"].encode(DATAOUT_CHANNEL=kernels - 1)),
        ("CORE_CLIP_TRUNCATE", 0),
        ("CORE_UNDOC_3030", 0),
        ("DPU_FEATURE_MODE_CFG", R["DPU_FEATURE_MODE_CFG"].encode(BURST_LEN=BURST_LEN, OUTPUT_MODE=OUTPUT_MODE_MEMORY)),
        ("DPU_DATA_FORMAT", R["DPU_DATA_FORMAT"].encode(OUT_PRECISION=dpu_out, IN_PRECISION=dpu_in, PROC_PRECISION=dpu_in)),
        ("DPU_OFFSET_PEND", 0),
        ("DPU_DST_BASE_ADDR", offsets["C"]),
        ("DPU_DST_SURF_STRIDE", R["DPU_DST_SURF_STRIDE"].encode(DST_SURF_STRIDE=shape.M * width)),
        ("DPU_DATA_CUBE_WIDTH", R["DPU_DATA_CUBE_WIDTH"].encode(WIDTH=width - 1)),
        ("DPU_DATA_CUBE_HEIGHT", R["DPU_DATA_CUBE_HEIGHT"].encode(HEIGHT=rows - 1)),
        ("DPU_DATA_CUBE_NOTCH_ADDR", 0),
        ("DPU_DATA_CUBE_CHANNEL", R["DPU_DATA_CUBE_CHANNEL"].encode(ORIG_CHANNEL=kernels - 1, CHANNEL=kernels - 1)),
        ("DPU_BS_CFG", R["DPU_BS_CFG"].encode(BS_RELU_BYPASS=1, BS_MUL_BYPASS=1, BS_ALU_BYPASS=1, BS_BYPASS=1)),
        ("DPU_BS_ALU_CFG", 0),
        ("DPU_BS_MUL_CFG", 0),
        ("DPU_BS_RELUX_CMP_VALUE", 0),
        ("DPU_BS_OW_CFG", R["DPU_BS_OW_CFG"].encode(SIZE_E_2=size_e, SIZE_E_1=size_e, SIZE_E_0=size_e, OD_BYPASS=1)),
        ("DPU_BS_OW_OP", 0),
        ("DPU_WDMA_SIZE_0", R["DPU_WDMA_SIZE_0"].encode(CHANNEL_WDMA=kernels - 1)),
        ("DPU_WDMA_SIZE_1", R["DPU_WDMA_SIZE_1"].encode(HEIGHT_WDMA=rows - 1, WIDTH_WDMA=width - 1)),
        ("DPU_BN_CFG", R["DPU_BN_CFG"].encode(BN_RELU_BYPASS=1, BN_MUL_BYPASS=1, BN_ALU_BYPASS=1, BN_BYPASS=1)),
        ("DPU_BN_ALU_CFG", 0),
        ("DPU_BN_MUL_CFG", 0),
        ("DPU_BN_RELUX_CMP_VALUE", 0),
        ("DPU_EW_CFG", R["DPU_EW_CFG"].encode(EW_RELU_BYPASS=1, EW_OP_CVT_BYPASS=1, EW_LUT_BYPASS=1,
                                              EW_OP_BYPASS=1, EW_BYPASS=1)),
        ("DPU_EW_CVT_OFFSET_VALUE", 0),
        ("DPU_EW_CVT_SCALE_VALUE", R["DPU_EW_CVT_SCALE_VALUE"].encode(EW_OP_CVT_SCALE=1)),
        ("DPU_EW_RELUX_CMP_VALUE", 0),
        ("DPU_OUT_CVT_OFFSET", 0),
        ("DPU_OUT_CVT_SCALE", R["DPU_OUT_CVT_SCALE"].encode(
            FP32TOFP16_EN=1 if c_dtype == "fp16" else 0, OUT_CVT_SCALE=1)),
        ("DPU_OUT_CVT_SHIFT", 0),
        *[(f"DPU_EW_OP_VALUE_{i}", 0) for i in range(8)],
        ("DPU_SURFACE_ADD", R["DPU_SURFACE_ADD"].encode(SURF_ADD=shape.M * width * (size_e + 1))),
        ("DPU_UNDOC_40C4", 0),
        *[(name, 0) for name in _LUT_REGISTERS],
    ]
    return regs
