"""CNA + CORE + DPU: the direct convolution a task's registers describe, executed with numpy.

Invariants: ``decode_conv`` first runs every hardware rule of ``validate.CONV_RULES``, then
this model's limits (``NotModeled``: a 1x1 kernel, stride 1, no padding, the matmul case;
DPU bypass path); layouts follow docs/npu-programming.md §6-§7; int8 x int8 -> int32 is
exact; fp16 products are exact and summed in fp32 (numpy's order, not the hardware's
unknown one), fp16 output rounded to nearest-even, so expect <= 1 fp16 ulp from a board.
The layouts, inferences and numerics with sources: docs/decisions.md "sim/conv.py". The
arithmetic is ``sim/gemm.py``, the decoded-operand cache ``sim/operands.py``, execution
``sim/execute.py``."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ggml_rknpu.hw import limits
from ggml_rknpu.sim.memory import DeviceMemory, DmaFault, device_write_view
from ggml_rknpu.sim.validate import (
    CONV_RULES,
    NotModeled,
    RegisterSource,
    cna_precision,
    dpu_out_precision,
    fld,
    output_dims,
    plane_height,
    refuse,
)

NUMPY_DTYPE = {"fp16": np.float16, "int8": np.int8, "fp32": np.float32, "int32": np.int32}
_MODELED = {("fp16", "fp32"), ("fp16", "fp16"), ("int8", "int32")}
# (task, features (M, K), weights (N, K)) -> the (M, N) accumulator: ``multiply`` or a ``Gemm``


@dataclass(frozen=True)
class ConvTask:
    """What one conv task computes, decoded from its registers."""

    precision: str            # "fp16" | "int8"   (CNA/CORE)
    out_precision: str        # "fp32" | "fp16" | "int32"   (DPU)
    width: int                # input W
    height: int               # input H (this task's rows)
    channels: int             # DATAIN_CHANNEL (K, padded)
    plane_height: int         # Hf, full plane height of the feature map in memory
    kernels: int              # WEIGHT_KERNELS (N)
    out_channels: int         # DPU channels written (N padded)
    stride_x: int
    stride_y: int
    kernel_w: int
    kernel_h: int
    feature_addr: int
    weight_addr: int
    weight_bytes: int
    dst_addr: int
    dst_plane_bytes: int
    data_banks: int
    weight_banks: int
    weight_reuse: bool = False   # CBUF_CON0.WEIGHT_REUSE: keep the weights already in CBUF
    data_reuse: bool = False     # CBUF_CON0.DATA_REUSE: keep the feature data already in CBUF

    @property
    def rows(self) -> int:
        """Matmul M of this task: H * W output pixels of a 1x1 convolution."""
        return self.height * self.width

    @property
    def feature_plane_bytes(self) -> int:
        return limits.ATOM_BYTES * self.width * self.plane_height

    @property
    def weight_key(self) -> tuple[int, int, int, int, str]:
        return (self.weight_addr, self.weight_bytes, self.kernels, self.channels, self.precision)

    @property
    def weights_resident(self) -> bool:
        """All of the task's weights fit its weight banks (else they stream through CBUF)."""
        return self.weight_bytes <= self.weight_banks * limits.CBUF_BANK_BYTES

    @property
    def data_key(self) -> tuple[int, int, int, int, int, str]:
        return (self.feature_addr, self.width, self.height, self.channels, self.plane_height,
                self.precision)


# Fields that are 0 in every golden and captured stream [golden/mtx512-single-task.json;
# captures/raw pw_c256_h14, c64_h56, h14] and whose effect is undocumented or unmodeled:
# another value is NotModeled rather than silently ignored.
ZERO_IN_EVERY_KNOWN_STREAM: dict[str, tuple[str, ...]] = {
    "CNA_CONV_CON2": ("CMD_FIFO_SRST", "CSC_DO_EN", "CSC_WO_EN", "KERNEL_GROUP"),
    "CNA_DATA_SIZE3": ("SURF_MODE",),
    "DPU_FEATURE_MODE_CFG": ("NONALIGN", "RGP_TYPE", "TP_EN", "COMB_USE"),
    "DPU_DATA_FORMAT": ("MC_SURF_OUT",),
    "DPU_DATA_CUBE_HEIGHT": ("MINMAX_CTL",),
    "DPU_DATA_CUBE_NOTCH_ADDR": ("NOTCH_ADDR_0", "NOTCH_ADDR_1"),
    "DPU_WDMA_SIZE_0": ("SIZE_C_WDMA", "TP_PRECISION"),
    "DPU_BS_OW_CFG": ("OW_SRC", "TP_ORG_EN", "RGP_CNTER"),
}


def _model_limits(regs: RegisterSource) -> None:
    """Refuse (NotModeled) what is legal but outside this simulator."""
    def need(register: str, field_name: str, want: int, what: str) -> None:
        got = fld(regs, register, field_name)
        if got != want:
            raise NotModeled(f"{register}.{field_name}={got} ({what}; modeled: {want})")

    need("CNA_CONV_CON1", "CONV_MODE", 0, "depthwise/other conv modes")
    need("CNA_CONV_CON1", "DECONV", 0, "deconvolution")
    need("CNA_CONV_CON1", "NONALIGN_DMA", 0, "non-aligned DMA")
    need("CNA_CONV_CON1", "ARGB_IN", 0, "image input path")
    need("CNA_CONV_CON3", "CONV_X_STRIDE", 1, "strided convolution")
    need("CNA_CONV_CON3", "CONV_Y_STRIDE", 1, "strided convolution")
    need("CNA_CONV_CON3", "ATROUS_X_DILATION", 0, "dilation")
    need("CNA_CONV_CON3", "ATROUS_Y_DILATION", 0, "dilation")
    need("CNA_CONV_CON3", "NN_MODE", 0, "multi-core co-work modes, unused by public code [§9]")
    need("CNA_WEIGHT_SIZE2", "WEIGHT_WIDTH", 1, "kernels wider than 1")
    need("CNA_WEIGHT_SIZE2", "WEIGHT_HEIGHT", 1, "kernels taller than 1")
    need("CNA_PAD_CON0", "PAD_TOP", 0, "padding")
    need("CNA_PAD_CON0", "PAD_LEFT", 0, "padding")
    need("CNA_CVT_CON0", "CVT_BYPASS", 1, "input converter")
    need("CNA_FC_CON0", "FC_SKIP_EN", 0, "FC zero skipping")
    need("CNA_DCOMP_CTRL", "DECOMP_CONTROL", 0, "weight decompression")
    need("CORE_MISC_CFG", "DW_EN", 0, "depthwise")
    need("CORE_CLIP_TRUNCATE", "CLIP_TRUNCATE", 0, "accumulator truncation")
    need("DPU_FEATURE_MODE_CFG", "FLYING_MODE", 0, "DPU input from MRDMA")
    need("DPU_FEATURE_MODE_CFG", "CONV_MODE", 0, "DPU depthwise mode")
    need("DPU_FEATURE_MODE_CFG", "OUTPUT_MODE", 2, "output to PPU; 2 = to memory [TRM]")
    need("DPU_BS_OW_CFG", "OD_BYPASS", 1, "the OW (weight zero-point) stage [§8]")
    for register, fields in ZERO_IN_EVERY_KNOWN_STREAM.items():
        for f in fields:
            need(register, f, 0, "nonzero in no known stream; effect unknown")
    c = fld(regs, "CNA_DATA_SIZE1", "DATAIN_CHANNEL")
    if c % limits.K_ALIGN:
        raise NotModeled(f"DATAIN_CHANNEL={c} is not a multiple of {limits.K_ALIGN}: the weight "
                         "layout of such kernels is unknown (the vendor packs C=40 kernels in "
                         "80 B, no padding [decoded c40_h40_oc320])")


def _check_precisions(regs: RegisterSource, prec: str, out: str) -> None:
    core = fld(regs, "CORE_MISC_CFG", "PROC_PRECISION")
    dpu_in = fld(regs, "DPU_DATA_FORMAT", "IN_PRECISION")
    dpu_proc = fld(regs, "DPU_DATA_FORMAT", "PROC_PRECISION")
    code = limits.CNA_PRECISION[prec]
    if core != code:
        refuse("precision", f"CORE_MISC_CFG.PROC_PRECISION={core} but CNA computes {prec} "
               f"(code {code}): CNA and CORE must agree", "CORE_MISC_CFG",
               regs.value("CORE_MISC_CFG"))
    if dpu_in != limits.DPU_PRECISION[prec] or dpu_proc != limits.DPU_PRECISION[prec]:
        refuse("precision", f"DPU_DATA_FORMAT IN/PROC_PRECISION={dpu_in}/{dpu_proc} but the "
               f"conv produces {prec} (code {limits.DPU_PRECISION[prec]}) [§7 DATA_FORMAT]",
               "DPU_DATA_FORMAT", regs.value("DPU_DATA_FORMAT"))
    if (prec, out) not in _MODELED:
        raise NotModeled(f"{prec} in, {out} out (modeled: fp16->fp32, fp16->fp16, int8->int32)")
    fp16_out = fld(regs, "DPU_OUT_CVT_SCALE", "FP32TOFP16_EN")
    if fp16_out != (out == "fp16"):
        raise NotModeled(f"OUT_CVT_SCALE.FP32TOFP16_EN={fp16_out} with {out} output")
    if fld(regs, "DPU_OUT_CVT_SCALE", "OUT_CVT_SCALE") != 1 or regs.value("DPU_OUT_CVT_SHIFT") \
            or regs.value("DPU_OUT_CVT_OFFSET"):
        raise NotModeled("OUT_CVT scale/shift/offset other than 1/0/0 (requantisation)")


def _check_dpu_stages(regs: RegisterSource, rdma_enabled: bool) -> None:
    """BS/BN/EW must be bypassed; a stage that takes its operand from memory needs DPU_RDMA
    in the op-enable mask (0x1D, MESA's bias path [§2, §8])."""
    stages = (("DPU_BS_CFG", "BS_BYPASS", "BS_ALU_SRC"), ("DPU_BN_CFG", "BN_BYPASS", "BN_ALU_SRC"),
              ("DPU_EW_CFG", "EW_BYPASS", "EW_OP_SRC"))
    for register, bypass, src in stages:
        if fld(regs, register, bypass):
            continue
        if fld(regs, register, src) and not rdma_enabled:
            refuse("missing-dpu-rdma", f"{register}.{src}=1 takes its operand from memory, but "
                   "the op-enable mask lacks DPU_RDMA (0x10): nothing feeds the stage "
                   "(*inference*; MESA's bias path enables 0x1D [§2, §8])", register,
                   regs.value(register))
        raise NotModeled(f"{register}: active DPU stage (only the bypass path is modeled)")


def decode_conv(regs: RegisterSource, rdma_enabled: bool = False) -> ConvTask:
    """All rules, then the model's limits, then the task's geometry and addresses."""
    for rule in CONV_RULES:
        rule(regs)
    prec = cna_precision(regs)
    out = dpu_out_precision(regs)
    _check_precisions(regs, prec, out)
    _model_limits(regs)
    _check_dpu_stages(regs, rdma_enabled)
    w = fld(regs, "CNA_DATA_SIZE0", "DATAIN_WIDTH")
    h = fld(regs, "CNA_DATA_SIZE0", "DATAIN_HEIGHT")
    ow, oh, och = output_dims(regs)
    if (ow, oh) != (w, h):
        refuse("output-shape", f"a 1x1 stride-1 conv of a {w}x{h} input gives {w}x{h}, but "
               f"CORE_DATAOUT_SIZE_0 says {ow}x{oh}", "CORE_DATAOUT_SIZE_0",
               regs.value("CORE_DATAOUT_SIZE_0"))
    return ConvTask(
        precision=prec,
        out_precision=out,
        width=w,
        height=h,
        channels=fld(regs, "CNA_DATA_SIZE1", "DATAIN_CHANNEL"),
        plane_height=plane_height(regs),
        kernels=fld(regs, "CNA_WEIGHT_SIZE2", "WEIGHT_KERNELS"),
        out_channels=och,
        stride_x=fld(regs, "CNA_CONV_CON3", "CONV_X_STRIDE"),
        stride_y=fld(regs, "CNA_CONV_CON3", "CONV_Y_STRIDE"),
        kernel_w=fld(regs, "CNA_WEIGHT_SIZE2", "WEIGHT_WIDTH"),
        kernel_h=fld(regs, "CNA_WEIGHT_SIZE2", "WEIGHT_HEIGHT"),
        feature_addr=regs.value("CNA_FEATURE_DATA_ADDR"),
        weight_addr=regs.value("CNA_DCOMP_ADDR0"),
        weight_bytes=regs.value("CNA_WEIGHT_SIZE0"),
        dst_addr=regs.value("DPU_DST_BASE_ADDR"),
        dst_plane_bytes=fld(regs, "DPU_DST_SURF_STRIDE", "DST_SURF_STRIDE") * limits.ATOM_BYTES,
        data_banks=fld(regs, "CNA_CBUF_CON0", "DATA_BANK"),
        weight_banks=fld(regs, "CNA_CBUF_CON0", "WEIGHT_BANK"),
        weight_reuse=bool(fld(regs, "CNA_CBUF_CON0", "WEIGHT_REUSE")),
        data_reuse=bool(fld(regs, "CNA_CBUF_CON0", "DATA_REUSE")),
    )


class DmaRead(Exception):
    """A DMA read fault while a conv task reads ``what``; wraps sim.memory.DmaFault."""

    def __init__(self, what: str, fault: Exception) -> None:
        super().__init__(f"{what}: {fault}")
        self.what, self.fault = what, fault


class DmaWrite(DmaRead):
    """A DMA write fault (output)."""


def _planes(memory: DeviceMemory, base: int, n_planes: int, pitch: int, plane_bytes: int,
            what: str, error: type[DmaRead]) -> np.ndarray:
    """(n_planes, plane_bytes) uint8 view of equally spaced planes, one DMA range check."""
    flat = _mapped(memory, base, (n_planes - 1) * pitch + plane_bytes, what, error)
    return np.ndarray((n_planes, plane_bytes), np.uint8, flat, 0, (pitch, 1))


def _mapped(memory: DeviceMemory, base: int, nbytes: int, what: str,
            error: type[DmaRead]) -> np.ndarray:
    """The DMA range check of [base, base+nbytes): its uint8 view (for a write when
    ``error`` is ``DmaWrite``), or ``error``."""
    try:
        if issubclass(error, DmaWrite):
            return device_write_view(memory, base, nbytes)
        return memory.view(base, nbytes)
    except DmaFault as fault:
        raise error(what, fault) from None


def _feature_planes(memory: DeviceMemory, task: ConvTask) -> np.ndarray:
    return _planes(memory, task.feature_addr, task.channels // limits.c2(task.precision),
                   task.feature_plane_bytes, task.rows * limits.ATOM_BYTES,
                   f"feature data (CNA_FEATURE_DATA_ADDR=0x{task.feature_addr:08X})", DmaRead)


def _output_planes(memory: DeviceMemory, task: ConvTask) -> np.ndarray:
    return _planes(memory, task.dst_addr, task.out_channels // limits.c2(task.out_precision),
                   task.dst_plane_bytes, task.rows * limits.ATOM_BYTES,
                   f"output (DPU_DST_BASE_ADDR=0x{task.dst_addr:08X})", DmaWrite)


def check_features(memory: DeviceMemory, task: ConvTask) -> None:
    """The DMA range check of ``_feature_planes``, without building the view."""
    _mapped(memory, task.feature_addr, feature_span(task),
            f"feature data (CNA_FEATURE_DATA_ADDR=0x{task.feature_addr:08X})", DmaRead)


def check_output(memory: DeviceMemory, task: ConvTask) -> None:
    """The DMA range check of ``_output_planes``, without building the view."""
    _mapped(memory, task.dst_addr, output_span(task),
            f"output (DPU_DST_BASE_ADDR=0x{task.dst_addr:08X})", DmaWrite)


def read_features(memory: DeviceMemory, task: ConvTask) -> np.ndarray:
    """(M, C) float32 feature matrix of the task from NC1HWC2 memory (one converting copy)."""
    c2 = limits.c2(task.precision)
    n_planes = task.channels // c2
    typed = _feature_planes(memory, task).view(NUMPY_DTYPE[task.precision])
    out = np.empty((task.rows, task.channels), dtype=np.float32)
    out.reshape(task.rows, n_planes, c2)[...] = typed.reshape(n_planes, task.rows, c2).transpose(1, 0, 2)
    return out


def weight_fault(task: ConvTask, fault: DmaFault) -> DmaRead:
    return DmaRead(f"weights (CNA_DCOMP_ADDR0=0x{task.weight_addr:08X}, "
                   f"CNA_WEIGHT_SIZE0={task.weight_bytes})", fault)


def read_weights(memory: DeviceMemory, task: ConvTask) -> np.ndarray:
    """(N, C) float32 kernels from the grouped layout (full groups + a packed partial one)."""
    g = limits.KERNEL_GROUP[task.precision]
    c, n, a = task.channels, task.kernels, limits.K_ALIGN
    try:
        raw = memory.view(task.weight_addr, task.weight_bytes)
    except DmaFault as fault:
        raise weight_fault(task, fault) from None
    values = raw.view(NUMPY_DTYPE[task.precision])
    full, rem = divmod(n, g)
    out = np.empty((n, c), dtype=np.float32)     # one converting, transposing copy
    out[: full * g].reshape(full, g, c // a, a)[...] = \
        values[: full * g * c].reshape(full, c // a, g, a).transpose(0, 2, 1, 3)
    if rem:
        out[full * g:].reshape(rem, c // a, a)[...] = \
            values[full * g * c:].reshape(c // a, rem, a).transpose(1, 0, 2)
    return out


def write_output(memory: DeviceMemory, task: ConvTask, acc: np.ndarray) -> None:
    """Convert to the output precision and write NC1HWC2 planes at DST_SURF_STRIDE pitch."""
    c2 = limits.c2(task.out_precision)
    n_planes = task.out_channels // c2
    if task.kernels == task.out_channels:     # no zero channels: convert straight into the planes
        typed = _output_planes(memory, task).view(NUMPY_DTYPE[task.out_precision])
        with np.errstate(over="ignore"):
            np.copyto(typed.reshape(n_planes, task.rows, c2),
                      acc.reshape(task.rows, n_planes, c2).transpose(1, 0, 2), casting="unsafe")
        return
    out = np.zeros((task.rows, task.out_channels), dtype=NUMPY_DTYPE[task.out_precision])
    with np.errstate(over="ignore"):
        out[:, : task.kernels] = acc.astype(out.dtype)
    atoms = np.ascontiguousarray(out.reshape(task.rows, n_planes, c2).transpose(1, 0, 2))
    planes = _output_planes(memory, task)
    planes[...] = atoms.view(np.uint8).reshape(n_planes, -1)


def extent(start: int, nbytes: int) -> tuple[int, int]:
    return start, start + nbytes


def overlap(a: tuple[int, int], b: tuple[int, int]) -> bool:
    return a[0] < b[1] and b[0] < a[1]


def feature_span(task: ConvTask) -> int:
    """Bytes from FEATURE_DATA_ADDR to the end of the task's rows in the last C1 plane."""
    return (task.channels // limits.c2(task.precision) - 1) * task.feature_plane_bytes \
        + task.rows * limits.ATOM_BYTES


def output_span(task: ConvTask) -> int:
    """Bytes from DST_BASE_ADDR to the end of the last output plane."""
    return (task.out_channels // limits.c2(task.out_precision) - 1) * task.dst_plane_bytes \
        + task.rows * limits.ATOM_BYTES

