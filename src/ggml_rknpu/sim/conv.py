"""CNA + CORE + DPU: the direct convolution a task's registers describe, executed with numpy.

Invariants: ``decode_conv`` first runs every hardware rule of ``validate.CONV_RULES``, then
this model's limits (``NotModeled``: a 1x1 kernel, stride 1, no padding, the matmul case;
DPU bypass path); layouts follow docs/npu-programming.md §6-§7; int8 x int8 -> int32 is
exact; fp16 products are exact and summed in fp32 (numpy's order, not the hardware's
unknown one), fp16 output rounded to nearest-even, so expect <= 1 fp16 ulp from a board.
The layouts, inferences and numerics with sources: docs/decisions.md "sim/conv.py"."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from typing import Protocol

import numpy as np

from ggml_rknpu.hw import limits
from ggml_rknpu.hw.alignment import ceil_div
from ggml_rknpu.sim.memory import DeviceMemory, DmaFault, content_token, device_write_view, note_device_write
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

INT8_EXACT_K_CHUNK = 1024      # 1024 * 2^14 = 2^24: exact integer partial sums in fp32
_NUMPY_DTYPE = {"fp16": np.float16, "int8": np.int8, "fp32": np.float32, "int32": np.int32}
_MODELED = {("fp16", "fp32"), ("fp16", "fp16"), ("int8", "int32")}
# (task, features (M, K), weights (N, K)) -> the (M, N) accumulator: ``multiply`` or a ``Gemm``
GemmFn = Callable[["ConvTask", np.ndarray, np.ndarray], np.ndarray]


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


def _check_features(memory: DeviceMemory, task: ConvTask) -> None:
    """The DMA range check of ``_feature_planes``, without building the view."""
    _mapped(memory, task.feature_addr, feature_span(task),
            f"feature data (CNA_FEATURE_DATA_ADDR=0x{task.feature_addr:08X})", DmaRead)


def _check_output(memory: DeviceMemory, task: ConvTask) -> None:
    """The DMA range check of ``_output_planes``, without building the view."""
    _mapped(memory, task.dst_addr, output_span(task),
            f"output (DPU_DST_BASE_ADDR=0x{task.dst_addr:08X})", DmaWrite)


def read_features(memory: DeviceMemory, task: ConvTask) -> np.ndarray:
    """(M, C) float32 feature matrix of the task from NC1HWC2 memory (one converting copy)."""
    c2 = limits.c2(task.precision)
    n_planes = task.channels // c2
    typed = _feature_planes(memory, task).view(_NUMPY_DTYPE[task.precision])
    out = np.empty((task.rows, task.channels), dtype=np.float32)
    out.reshape(task.rows, n_planes, c2)[...] = typed.reshape(n_planes, task.rows, c2).transpose(1, 0, 2)
    return out


def _weight_fault(task: ConvTask, fault: DmaFault) -> DmaRead:
    return DmaRead(f"weights (CNA_DCOMP_ADDR0=0x{task.weight_addr:08X}, "
                   f"CNA_WEIGHT_SIZE0={task.weight_bytes})", fault)


def read_weights(memory: DeviceMemory, task: ConvTask) -> np.ndarray:
    """(N, C) float32 kernels from the grouped layout (full groups + a packed partial one)."""
    g = limits.KERNEL_GROUP[task.precision]
    c, n, a = task.channels, task.kernels, limits.K_ALIGN
    try:
        raw = memory.view(task.weight_addr, task.weight_bytes)
    except DmaFault as fault:
        raise _weight_fault(task, fault) from None
    values = raw.view(_NUMPY_DTYPE[task.precision])
    full, rem = divmod(n, g)
    out = np.empty((n, c), dtype=np.float32)     # one converting, transposing copy
    out[: full * g].reshape(full, g, c // a, a)[...] = \
        values[: full * g * c].reshape(full, c // a, g, a).transpose(0, 2, 1, 3)
    if rem:
        out[full * g:].reshape(rem, c // a, a)[...] = \
            values[full * g * c:].reshape(c // a, rem, a).transpose(1, 0, 2)
    return out


class GemmTask(Protocol):
    """What a GEMM reads of its task (a ``ConvTask``): the CNA precision."""

    @property
    def precision(self) -> str: ...


def multiply(task: GemmTask, a: np.ndarray, b_nk: np.ndarray) -> np.ndarray:
    """(M, N) accumulator: int64 exact for int8, float32 for fp16 (module docstring)."""
    if task.precision == "int8":
        acc = np.zeros((a.shape[0], b_nk.shape[0]), dtype=np.int64)
        for k0 in range(0, a.shape[1], INT8_EXACT_K_CHUNK):
            k1 = k0 + INT8_EXACT_K_CHUNK
            acc += (a[:, k0:k1] @ b_nk[:, k0:k1].T).astype(np.int64)
        if acc.size and int(np.abs(acc).max()) >= 1 << 31:
            raise NotModeled("int32 accumulator overflow (RK behaviour unverified [§10])")
        return acc
    return a @ b_nk.T


# A one-row fp16 GEMM over at least this many bytes of decoded weights is split across host
# threads: it streams them from DRAM for >= 2 ms on one core of the x86 dev box (gemma3-270m's
# output projection: 671 MB, ~42 ms), long enough that the hand-offs cost nothing; smaller
# ones (its 5 MB FFN weights) gained less than the hand-offs cost on a loaded host.
SPLIT_MIN_WEIGHT_BYTES = 32 << 20
SPLIT_BLOCK_BYTES = 2 << 20      # the threads share out blocks of at least this size,
SPLIT_MAX_BLOCKS = 16            # at most this many (each costs a hand-off)
SPLIT_ROW_ALIGN = 64


def _gemv_into(a: np.ndarray, b_kn: np.ndarray, out: np.ndarray) -> None:
    np.matmul(a, b_kn, out=out)


class Gemm:
    """``multiply`` of a task, on up to ``threads`` host threads.

    A one-row (M=1) fp16 task over large weights runs as one BLAS call per contiguous block
    of weight rows; the blocks follow from the task's shape alone, and ``threads`` only
    decides how many host threads share them out (numpy releases the GIL in BLAS). So the
    result does not depend on the thread count, bit for bit, on any BLAS: the same calls on
    the same operands. It may differ from one unsplit call in the last fp32 bit, because a
    BLAS picks its kernel and its own thread split per shape (OpenBLAS with two threads sums
    the last columns of a 322-row gemv differently from a 130-row one): the model's fp16
    numerics leave the summation order open (module docstring). No block has one row:
    numpy computes a 1 x 1 result with sdot. Other tasks (M > 1, int8) run as ``multiply``.
    The host threads are a speed of this simulator on a multi-core host; they say nothing
    about the NPU."""

    def __init__(self, threads: int = 1) -> None:
        self.threads = max(1, threads)
        self._pool: ThreadPoolExecutor | None = None
        self.split_calls = 0

    def __call__(self, task: GemmTask, a: np.ndarray, b_nk: np.ndarray) -> np.ndarray:
        n = b_nk.shape[0]
        if (task.precision != "fp16" or a.shape[0] != 1
                or b_nk.nbytes < SPLIT_MIN_WEIGHT_BYTES or n < 2 * SPLIT_ROW_ALIGN):
            return multiply(task, a, b_nk)
        n_blocks = min(SPLIT_MAX_BLOCKS, max(2, b_nk.nbytes // SPLIT_BLOCK_BYTES))
        rows = ceil_div(n, n_blocks * SPLIT_ROW_ALIGN) * SPLIT_ROW_ALIGN
        cuts = [j for j in range(rows, n, rows) if n - j >= 2]   # no one-row block (see above)
        out = np.empty((1, n), dtype=np.float32)
        blocks = [(a, b_nk[j0:j1].T, out[:, j0:j1]) for j0, j1 in zip([0, *cuts], [*cuts, n])]
        self.split_calls += 1
        if self.threads == 1:
            for block in blocks:
                _gemv_into(*block)
            return out
        if self._pool is None:
            self._pool = ThreadPoolExecutor(self.threads - 1, thread_name_prefix="sim-gemm")
        # The workers take blocks from the front, this thread from the back: on a loaded
        # host it waits for at most the blocks a worker has started.
        futures = [self._pool.submit(_gemv_into, *block) for block in blocks[:-1]]
        _gemv_into(*blocks[-1])
        for block, future in zip(reversed(blocks[:-1]), reversed(futures)):
            if not future.cancel():
                break          # a worker has got this far: the blocks before are started
            _gemv_into(*block)
        for future in futures:
            if not future.cancelled():
                future.result()
        return out

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown()
            self._pool = None


def write_output(memory: DeviceMemory, task: ConvTask, acc: np.ndarray) -> None:
    """Convert to the output precision and write NC1HWC2 planes at DST_SURF_STRIDE pitch."""
    c2 = limits.c2(task.out_precision)
    n_planes = task.out_channels // c2
    if task.kernels == task.out_channels:     # no zero channels: convert straight into the planes
        typed = _output_planes(memory, task).view(_NUMPY_DTYPE[task.out_precision])
        with np.errstate(over="ignore"):
            np.copyto(typed.reshape(n_planes, task.rows, c2),
                      acc.reshape(task.rows, n_planes, c2).transpose(1, 0, 2), casting="unsafe")
        return
    out = np.zeros((task.rows, task.out_channels), dtype=_NUMPY_DTYPE[task.out_precision])
    with np.errstate(over="ignore"):
        out[:, : task.kernels] = acc.astype(out.dtype)
    atoms = np.ascontiguousarray(out.reshape(task.rows, n_planes, c2).transpose(1, 0, 2))
    planes = _output_planes(memory, task)
    planes[...] = atoms.view(np.uint8).reshape(n_planes, -1)


def _extent(start: int, nbytes: int) -> tuple[int, int]:
    return start, start + nbytes


def _overlap(a: tuple[int, int], b: tuple[int, int]) -> bool:
    return a[0] < b[1] and b[0] < a[1]


WEIGHT_CACHE_BYTES = 3 << 30    # decoded fp32 weights kept across runs (gemma3-270m: ~1.1 GiB)
FEATURE_CACHE_BYTES = 256 << 20  # decoded fp32 features (the cores of one submit share A)
# Decoded weights are kept from their second read of the same bytes on: a replayed program
# (every decode token) reads them again, a weight multiplied once (a test case, a MoE expert
# one graph routes to once) is decoded, used and dropped, and costs no host memory after.
SEEN_KEYS = 1 << 16              # weights read once, remembered by key and token
_UNSEEN = object()


class _Decoded:
    """Decoded operands by key, each valid while the memory's content token of its bytes is
    unchanged (``sim.memory.content_token``); least recently used beyond ``max_bytes``.
    An entry with a token needs no address check when the NPU writes: the write bumps the
    token (``note_device_write``). Entries without one are checked by address
    (``invalidate``) and dropped at the end of the run."""

    def __init__(self, max_bytes: int, admit_on_reuse: bool = False) -> None:
        self.max_bytes = max_bytes
        self.admit_on_reuse = admit_on_reuse
        self._entries: OrderedDict[tuple, tuple[object, tuple[int, int], np.ndarray]] = OrderedDict()
        self._untracked: set[tuple] = set()
        self._seen: OrderedDict[tuple, object] = OrderedDict()   # key -> token, read once
        self._bytes = 0

    def get(self, key: tuple, token: object, extent: tuple[int, int],
            read: Callable[[], np.ndarray]) -> np.ndarray:
        hit = self._entries.get(key)
        if hit is not None and hit[0] == token:
            self._entries.move_to_end(key)
            return hit[2]
        value = read()
        if self.admit_on_reuse and token is not None and self._seen.pop(key, _UNSEEN) != token:
            self._drop(key)
            self._seen[key] = token               # kept only if the same bytes are read again
            if len(self._seen) > SEEN_KEYS:
                self._seen.popitem(last=False)
            return value
        self._drop(key)
        self._entries[key] = (token, extent, value)
        if token is None:
            self._untracked.add(key)
        self._bytes += value.nbytes
        self.trim()
        return value

    def trim(self) -> None:
        while self._bytes > self.max_bytes and len(self._entries) > 1:
            self._drop(next(iter(self._entries)))

    def _drop(self, key: tuple) -> None:
        old = self._entries.pop(key, None)
        if old is not None:
            self._bytes -= old[2].nbytes
            self._untracked.discard(key)

    def invalidate(self, start: int, nbytes: int) -> None:
        for key in [k for k in self._untracked if _overlap(self._entries[k][1], (start, start + nbytes))]:
            self._drop(key)

    def forget(self, start: int, nbytes: int) -> None:
        """The memory [start, start + nbytes) was freed: drop every entry decoded from it."""
        for key in [k for k, e in self._entries.items() if _overlap(e[1], (start, start + nbytes))]:
            self._drop(key)
        for key in [k for k in self._seen if _overlap((k[0], k[0] + k[1]), (start, start + nbytes))]:
            del self._seen[key]

    def end_run(self) -> None:
        for key in list(self._untracked):
            self._drop(key)

    def clear(self) -> None:
        self._entries.clear()
        self._untracked.clear()
        self._seen.clear()
        self._bytes = 0


class OperandCache:
    """Decoded (N, C) weights and (M, C) features, so tasks, cores and jobs reading the same
    bytes decode them once: replayed programs skip the weight decode (from the second read
    of the same bytes on: ``SEEN_KEYS``), and the cores of one submit share the decode of A. An entry is keyed by the task's registers and used only
    while the memory's content token of its bytes is unchanged (no sync, no NPU write to
    the object since), so a changed operand is always read again. Entries without a token
    (memory that cannot tell) are dropped when a task writes over them (``invalidate``) and
    at the end of every run."""

    def __init__(self, weight_bytes: int = WEIGHT_CACHE_BYTES,
                 feature_bytes: int = FEATURE_CACHE_BYTES) -> None:
        self._weights = _Decoded(weight_bytes, admit_on_reuse=True)
        self._features = _Decoded(feature_bytes)

    def check_weights(self, memory: DeviceMemory, task: ConvTask) -> object | None:
        """The DMA range check of the task's weights (``_weight_fault``); their token."""
        try:
            if not hasattr(memory, "content_token"):
                memory.view(task.weight_addr, task.weight_bytes)
            return content_token(memory, task.weight_addr, task.weight_bytes)
        except DmaFault as fault:
            raise _weight_fault(task, fault) from None

    def weights(self, memory: DeviceMemory, task: ConvTask) -> np.ndarray:
        token = self.check_weights(memory, task)
        return self._weights.get(task.weight_key, token, _extent(task.weight_addr, task.weight_bytes),
                                 lambda: read_weights(memory, task))

    def features(self, memory: DeviceMemory, task: ConvTask) -> np.ndarray:
        start, nbytes = task.feature_addr, feature_span(task)
        _check_features(memory, task)          # the range check (and fault) of read_features
        token = content_token(memory, start, nbytes)
        return self._features.get(task.data_key, token, _extent(start, nbytes),
                                  lambda: read_features(memory, task))

    def invalidate(self, start: int, nbytes: int) -> None:
        self._weights.invalidate(start, nbytes)
        self._features.invalidate(start, nbytes)

    def limit_weights(self, max_bytes: int) -> None:
        """Keep at most ``max_bytes`` of decoded weights (least recently used go first)."""
        self._weights.max_bytes = max_bytes
        self._weights.trim()

    def forget(self, start: int, nbytes: int) -> None:
        """The NPU memory [start, start + nbytes) was freed: its decoded copies can never be
        read again (new memory there has a new token), so they go now, not when LRU gets to them."""
        self._weights.forget(start, nbytes)
        self._features.forget(start, nbytes)

    def end_run(self) -> None:
        """Drop what no content token vouches for (it may change before the next run)."""
        self._weights.end_run()
        self._features.end_run()

    def clear(self) -> None:
        self._weights.clear()
        self._features.clear()


def feature_span(task: ConvTask) -> int:
    """Bytes from FEATURE_DATA_ADDR to the end of the task's rows in the last C1 plane."""
    return (task.channels // limits.c2(task.precision) - 1) * task.feature_plane_bytes \
        + task.rows * limits.ATOM_BYTES


def output_span(task: ConvTask) -> int:
    """Bytes from DST_BASE_ADDR to the end of the last output plane."""
    return (task.out_channels // limits.c2(task.out_precision) - 1) * task.dst_plane_bytes \
        + task.rows * limits.ATOM_BYTES


def execute_conv(memory: DeviceMemory, task: ConvTask, cache: OperandCache,
                 gemm: GemmFn = multiply) -> None:
    a = cache.features(memory, task)
    b = cache.weights(memory, task)
    write_output(memory, task, gemm(task, a, b))
    span = output_span(task)
    cache.invalidate(task.dst_addr, span)
    note_device_write(memory, task.dst_addr, span)


# int8: |acc| <= K * 128 * 128 = K * 2^14 < 2^31 for K < 2^17, so such a task cannot hit the
# accumulator-overflow NotModeled; fp16 tasks cannot fail once their addresses are mapped.
INT8_NO_OVERFLOW_K = 1 << 17


def _cannot_fail_once_mapped(task: ConvTask) -> bool:
    return task.precision != "int8" or task.channels < INT8_NO_OVERFLOW_K


class BulkConv:
    """Execute the conv tasks of one run in bulk, as one task of all their rows or kernels -
    one feature read, one GEMM, one output write - instead of one small set of numpy calls
    each. Two kinds of batch:

    * M tiles: consecutive tasks over the same weights (the same kernels, the next rows of
      the same feature and output planes);
    * N tiles of one row: consecutive one-row tasks over the same features whose weights
      follow each other in memory (whole kernel groups, packed exactly) and whose outputs
      are the next channel planes (e.g. gemma3-270m's output projection: 32 tiles of 8192
      kernels become one GEMM over 262144). Only for one row, and never a one-kernel task
      (numpy computes its 1 x 1 result with sdot).

    Equivalent to ``execute_conv`` task by task up to the fp32 summation order (exact for
    int8; for fp16 a BLAS picks its kernel per shape, so the merged GEMM may round an
    element differently, which the model's fp16 numerics allow: docs/simulator.md), because
    a task joins the pending batch only if (a) nothing can fail once its addresses are
    mapped (fp16; int8 with K < 2^17),
    and its features, weights and output were checked mapped when it was submitted (a
    fault flushes the batch first, then raises the same error ``execute_conv`` would);
    (b) the batch's outputs overlap none of its inputs; (c) the caller flushes before
    anything else reads memory the batch writes (``writes_into``: the next regcmd fetch)
    and at the end of the run. tests/sim/test_sim_bulk.py checks it.
    """

    def __init__(self, memory: DeviceMemory, cache: OperandCache,
                 gemm: GemmFn = multiply) -> None:
        self.memory, self.cache, self.gemm = memory, cache, gemm
        self.pending: list[ConvTask] = []
        self.tasks_merged = 0

    def submit(self, task: ConvTask) -> None:
        if self.pending and not self._joins(task):
            self.flush()
        if not _cannot_fail_once_mapped(task):
            self.flush()
            execute_conv(self.memory, task, self.cache, self.gemm)
            return
        try:
            _check_features(self.memory, task)
            self.cache.check_weights(self.memory, task)
            _check_output(self.memory, task)
        except DmaRead:
            self.flush()
            raise
        self.pending.append(task)

    def writes_into(self, start: int, nbytes: int) -> bool:
        """Would the pending tasks write any of [start, start+nbytes)?"""
        if not self.pending:
            return False
        merged = self._merged(self.pending)
        return _overlap(_extent(start, nbytes), _extent(merged.dst_addr, output_span(merged)))

    def flush(self) -> None:
        if not self.pending:
            return
        tasks, self.pending = self.pending, []
        execute_conv(self.memory, self._merged(tasks), self.cache, self.gemm)
        self.tasks_merged += len(tasks) - 1

    @staticmethod
    def _merged(tasks: list[ConvTask]) -> ConvTask:
        if len(tasks) == 1:
            return tasks[0]
        first = tasks[0]
        if tasks[1].weight_key == first.weight_key:      # M tiles
            return replace(first, width=1, height=sum(t.rows for t in tasks),
                           plane_height=first.feature_plane_bytes // limits.ATOM_BYTES)
        return replace(first, kernels=sum(t.kernels for t in tasks),      # N tiles
                       out_channels=sum(t.out_channels for t in tasks),
                       weight_bytes=sum(t.weight_bytes for t in tasks))

    def _joins(self, task: ConvTask) -> bool:
        first = self.pending[0]
        if not (_cannot_fail_once_mapped(task) and task.out_precision == first.out_precision
                and task.dst_plane_bytes == first.dst_plane_bytes):
            return False
        # the batch's kind is set by its second task: M tiles share the first one's weights
        second = self.pending[1] if len(self.pending) > 1 else task
        n_tiles = second.weight_key != first.weight_key
        if not (self._next_n_tile(task) if n_tiles else self._next_m_tile(task)):
            return False
        merged = self._merged([*self.pending, task])
        if merged.rows * limits.ATOM_BYTES > min(merged.feature_plane_bytes, merged.dst_plane_bytes):
            return False
        reads = (_extent(merged.feature_addr, feature_span(merged)),
                 _extent(merged.weight_addr, merged.weight_bytes))
        writes = _extent(merged.dst_addr, output_span(merged))
        if any(_overlap(writes, r) for r in reads):
            return False
        try:
            _check_features(self.memory, merged)
            _check_output(self.memory, merged)
            self.cache.check_weights(self.memory, merged)
        except DmaRead:   # the rows or kernels run across two buffers: keep them apart
            return False
        return True

    def _next_m_tile(self, task: ConvTask) -> bool:
        first, last = self.pending[0], self.pending[-1]
        atom = limits.ATOM_BYTES
        return (task.weight_key == first.weight_key and task.out_channels == first.out_channels
                and task.feature_plane_bytes == first.feature_plane_bytes
                and task.feature_addr == last.feature_addr + last.rows * atom
                and task.dst_addr == last.dst_addr + last.rows * atom)

    def _next_n_tile(self, task: ConvTask) -> bool:
        first, last = self.pending[0], self.pending[-1]
        kernel_bytes = last.channels * np.dtype(_NUMPY_DTYPE[last.precision]).itemsize
        return (task.rows == 1 and task.data_key == first.data_key
                and task.kernels >= 2 and first.kernels >= 2   # one kernel alone: numpy's sdot
                and last.kernels == last.out_channels
                and last.kernels % limits.KERNEL_GROUP[last.precision] == 0
                and last.weight_bytes == last.kernels * kernel_bytes
                and task.weight_addr == last.weight_addr + last.weight_bytes
                and task.dst_addr == last.dst_addr
                + last.out_channels // limits.c2(last.out_precision) * last.dst_plane_bytes)
