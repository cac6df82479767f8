"""What the NPU refuses or hangs on, as rules with a symptom and an actionable diagnostic.

The same rules judge a live task (registers read through ``regfile.TaskView``, where a
missing register is itself a violation) and a partial decoded field set (a capture's
JSON; a rule whose registers are absent is skipped, not passed). Invariant: three outcomes
kept apart, so a model gap is never mistaken for a hardware rule: ``TaskRefused`` (a board
would hang, fault or compute garbage), ``NotModeled`` (legal-looking behaviour this model
lacks), and DMA faults from the memory model. Rules cite docs/npu-programming.md, the TRM,
captures and golden streams, and say so where a rule is an empirical fit."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from functools import cache
from typing import Protocol

from ggml_rknpu.hw import limits
from ggml_rknpu.hw.alignment import ceil_div
from ggml_rknpu.hw.registers import REGISTERS

# --- symptoms a developer would see on a board --------------------------------------------
# Which symptom a given broken rule produces on silicon is *inference*: the public record
# is that bad configurations end in job timeouts that need a reset [§3 completion; AB's
# experiments, §12.2] and that unmapped addresses raise the DMA error bits [§3; ROCKET
# WARNs on them]. The simulator reports the modeled symptom next to the rule.
SYMPTOM_HANG = (
    "on a board: no completion interrupt; the kernel waits out its timeout (ETIMEDOUT) "
    "and soft-resets the NPU"
)
SYMPTOM_DMA_FAULT = (
    "on a board: IOMMU/DMA fault (raw status DMA error bit), no completion interrupt; "
    "the kernel times out and resets"
)
SYMPTOM_STALE = (
    "on a board: the task silently uses a stale value left in the ping-pong register "
    "group by an earlier task (wrong results); refused here so it is caught"
)
SYMPTOM_SILENT = (
    "on a board: no error; the task silently computes with the old CBUF content (wrong "
    "results); refused here so it is caught"
)
SYMPTOM_NOT_MODELED = "not modeled by the simulator; this is not a hardware verdict"


@dataclass(frozen=True)
class Violation:
    """One broken rule: which task, which register, which rule, what value, what a board does."""

    rule: str
    message: str
    register: str | None = None
    value: int | None = None
    task: int | None = None
    symptom: str = SYMPTOM_HANG

    def describe(self) -> str:
        where = f"task {self.task}: " if self.task is not None else ""
        reg = ""
        if self.register is not None:
            reg = f" [{self.register}"
            reg += f"=0x{self.value:08X}]" if self.value is not None else "]"
        return f"{where}rule '{self.rule}'{reg}: {self.message} ({self.symptom})"


class TaskRefused(Exception):
    """Raised when a task breaks a hardware rule; carries the ``Violation``."""

    def __init__(self, violation: Violation) -> None:
        super().__init__(violation.describe())
        self.violation = violation


class NotModeled(Exception):
    """Raised for behaviour outside the simulator's model (not a hardware verdict)."""


class Unavailable(Exception):
    """A register is absent from a partial field set; the rule needing it is skipped."""


class RegisterSource(Protocol):
    """Read access to a task's registers by database name (``CNA_CONV_CON1``)."""

    def value(self, name: str) -> int: ...


def fld(regs: RegisterSource, name: str, field_name: str) -> int:
    """One named field of a register, decoded with the hw database (no shifts here)."""
    return REGISTERS[name].field(field_name).extract(regs.value(name))


def refuse(rule: str, message: str, register: str | None = None, value: int | None = None,
           symptom: str = SYMPTOM_HANG) -> None:
    raise TaskRefused(Violation(rule, message, register, value, symptom=symptom))


# --- precision ----------------------------------------------------------------------------
_CNA_CODE = {code: name for name, code in limits.CNA_PRECISION.items()}   # [TRM; §1]
_DPU_CODE = {code: name for name, code in limits.DPU_PRECISION.items()}   # [TRM; §1]
# Input -> outputs the simulator executes, with their 16-byte-atom channel counts [§6, §7].
_MODELED_OUTPUTS = {"fp16": ("fp32", "fp16"), "int8": ("int32",)}


def cna_precision(regs: RegisterSource) -> str:
    """CNA input precision name; refuses reserved codes, NotModeled for unmodeled ones."""
    code = fld(regs, "CNA_CONV_CON1", "IN_PRECISION")
    proc = fld(regs, "CNA_CONV_CON1", "PROC_PRECISION")
    for what, c in (("IN_PRECISION", code), ("PROC_PRECISION", proc)):
        if c not in _CNA_CODE:
            refuse("field-range", f"CONV_CON1.{what}={c} is a reserved precision code "
                   f"(valid: {sorted(_CNA_CODE)}) [TRM CNA CONV_CON1]",
                   "CNA_CONV_CON1", regs.value("CNA_CONV_CON1"))
    if code != proc:
        raise NotModeled(f"CNA_CONV_CON1 IN_PRECISION={_CNA_CODE[code]} differs from "
                         f"PROC_PRECISION={_CNA_CODE[proc]} (input conversion)")
    name = _CNA_CODE[code]
    if name not in _MODELED_OUTPUTS:
        raise NotModeled(f"CNA precision {name} (modeled: int8, fp16)")
    return name


def dpu_out_precision(regs: RegisterSource) -> str:
    code = fld(regs, "DPU_DATA_FORMAT", "OUT_PRECISION")
    if code not in _DPU_CODE:
        refuse("field-range", f"DPU_DATA_FORMAT.OUT_PRECISION={code} is a reserved code "
               f"[TRM DPU DATA_FORMAT]", "DPU_DATA_FORMAT", regs.value("DPU_DATA_FORMAT"))
    return _DPU_CODE[code]


def surface_multiplier(in_precision: str, out_precision: str) -> int:
    """S = kernel-group size x output bytes / 16: the empirical SURFACE_ADD / SIZE_E rule,
    fitted to every MTX, MESA and blob value [§7 'S rule'; captures pw_c256_h14]."""
    return limits.KERNEL_GROUP[in_precision] * limits.BYTES[out_precision] // limits.ATOM_BYTES


# --- reserved bits = a value that does not fit its field -----------------------------------
# Reserved bits that real, working streams set; meaning unknown, so they are tolerated.
RESERVED_BITS_SEEN_IN_WORKING_STREAMS: dict[str, tuple[int, str]] = {
    "CNA_CONV_CON2": (0x7000_0000, "bits 30:28 set on later tiles by the vendor compiler "
                      "[§7 notes; capture pw_c256_h14; decoded c1024_h1_oc1001]"),
    "PC_REGISTER_AMOUNTS": (0xFFFF_0000, "upper half 0x0001/0x0002 in the vendor's in-stream "
                            "tails [capture pw_c256_h14]"),
}


@cache
def _reserved_mask(name: str) -> int:
    mask = 0
    for f in REGISTERS[name].fields:
        if f.name.startswith("RESERVED"):
            mask |= f.mask
    return mask & ~RESERVED_BITS_SEEN_IN_WORKING_STREAMS.get(name, (0, ""))[0]


def reserved_bits(name: str, value: int) -> int:
    """Bits of ``value`` that fall in RESERVED fields of register ``name`` (tolerated ones cleared)."""
    return value & _reserved_mask(name)


def check_reserved(name: str, value: int) -> None:
    """'fields out of range': a value wider than its field spills into reserved bits."""
    bad = reserved_bits(name, value)
    if bad:
        reg = REGISTERS[name]
        spilled = [f"{f.name}[{f.hi}:{f.lo}]" for f in reg.fields
                   if f.name.startswith("RESERVED") and f.extract(bad)]
        neighbours = ", ".join(f"{f.name}[{f.hi}:{f.lo}]" for f in reg.fields
                               if not f.name.startswith("RESERVED"))
        refuse("field-range", f"value sets reserved bits 0x{bad:08X} ({', '.join(spilled)}): "
               f"a field value does not fit its width; fields are {neighbours} [registers.xml]",
               name, value)


# --- convolution rules ------------------------------------------------------------------------
def rule_cbuf_banks(regs: RegisterSource) -> None:
    """DATA_BANK + WEIGHT_BANK <= 12 banks of 32 KiB, both >= 1 [§1, §7, §9; TRM 384KB]."""
    data = fld(regs, "CNA_CBUF_CON0", "DATA_BANK")
    weight = fld(regs, "CNA_CBUF_CON0", "WEIGHT_BANK")
    v = regs.value("CNA_CBUF_CON0")
    if data + weight > limits.CBUF_BANKS:
        refuse("cbuf-banks", f"DATA_BANK={data} + WEIGHT_BANK={weight} = {data + weight} "
               f"exceeds the {limits.CBUF_BANKS} CBUF banks of a core", "CNA_CBUF_CON0", v)
    if data < 1 or weight < limits.MIN_WEIGHT_BANKS:
        refuse("cbuf-banks", f"DATA_BANK={data}, WEIGHT_BANK={weight}: both need at least "
               "one bank", "CNA_CBUF_CON0", v)


def rule_cbuf_input(regs: RegisterSource) -> None:
    """The task's input (H*W*C*bytes) must fit its DATA_BANKs [§9 'CBUF capacity'; MTX]."""
    prec = cna_precision(regs)
    h = fld(regs, "CNA_DATA_SIZE0", "DATAIN_HEIGHT")
    w = fld(regs, "CNA_DATA_SIZE0", "DATAIN_WIDTH")
    c = fld(regs, "CNA_DATA_SIZE1", "DATAIN_CHANNEL")
    banks = fld(regs, "CNA_CBUF_CON0", "DATA_BANK")
    need = h * w * c * limits.BYTES[prec]
    if need > banks * limits.CBUF_BANK_BYTES:
        refuse("cbuf-input", f"input {h}x{w}x{c} {prec} = {need} B does not fit DATA_BANK={banks} "
               f"({banks * limits.CBUF_BANK_BYTES} B); tile M/H smaller or give data more banks",
               "CNA_CBUF_CON0", regs.value("CNA_CBUF_CON0"))


def rule_weight_size(regs: RegisterSource) -> None:
    """WEIGHT_SIZE1 = kw*kh*C*b, WEIGHT_SIZE0 = kernels*WEIGHT_SIZE1 [§7 table; holds in all
    83 decoded captures, e.g. c1024_h1_oc1001 2050048 = 1001*2048], and one kernel fits the
    weight banks (*inference*: CBUF must hold at least one whole kernel). NOT enforced: MTX's 'one kernel <= one bank' (§9), because the vendor's
    5x5x768 depthwise kernel is 38400 B [decoded c768_h20_oc768_s1pvalid]."""
    prec = cna_precision(regs)
    kw = fld(regs, "CNA_WEIGHT_SIZE2", "WEIGHT_WIDTH")
    kh = fld(regs, "CNA_WEIGHT_SIZE2", "WEIGHT_HEIGHT")
    kernels = fld(regs, "CNA_WEIGHT_SIZE2", "WEIGHT_KERNELS")
    c = fld(regs, "CNA_DATA_SIZE1", "DATAIN_CHANNEL")
    per_kernel = fld(regs, "CNA_WEIGHT_SIZE1", "WEIGHT_BYTES_PER_KERNEL")
    total = regs.value("CNA_WEIGHT_SIZE0")
    if kernels < 1 or kw < 1 or kh < 1:
        refuse("field-range", f"WEIGHT_SIZE2 kernels={kernels} width={kw} height={kh}: all must "
               "be >= 1", "CNA_WEIGHT_SIZE2", regs.value("CNA_WEIGHT_SIZE2"))
    expect = kw * kh * c * limits.BYTES[prec]
    if per_kernel != expect:
        refuse("weight-size", f"WEIGHT_BYTES_PER_KERNEL={per_kernel} but {kw}x{kh}x{c} {prec} "
               f"kernels are {expect} B", "CNA_WEIGHT_SIZE1", regs.value("CNA_WEIGHT_SIZE1"))
    weight_banks = fld(regs, "CNA_CBUF_CON0", "WEIGHT_BANK")
    if per_kernel > weight_banks * limits.CBUF_BANK_BYTES:
        refuse("cbuf-weights", f"one kernel is {per_kernel} B, more than WEIGHT_BANK={weight_banks} "
               f"banks hold ({weight_banks * limits.CBUF_BANK_BYTES} B); split K",
               "CNA_CBUF_CON0", regs.value("CNA_CBUF_CON0"))
    if total != kernels * per_kernel:
        refuse("weight-size", f"WEIGHT_BYTES={total} but {kernels} kernels x {per_kernel} B = "
               f"{kernels * per_kernel}", "CNA_WEIGHT_SIZE0", total)


def rule_dma_size(regs: RegisterSource) -> None:
    """The feature DMA cube equals the data cube: FC_DATA_SIZE0/1 = DATA_SIZE0/1 [§7 table]."""
    pairs = (("DMA_WIDTH", "DATAIN_WIDTH"), ("DMA_HEIGHT", "DATAIN_HEIGHT"))
    for dma_f, data_f in pairs:
        a = fld(regs, "CNA_FC_DATA_SIZE0", dma_f)
        b = fld(regs, "CNA_DATA_SIZE0", data_f)
        if a != b:
            refuse("dma-size", f"FC_DATA_SIZE0.{dma_f}={a} differs from DATA_SIZE0.{data_f}={b}",
                   "CNA_FC_DATA_SIZE0", regs.value("CNA_FC_DATA_SIZE0"))
    ch = fld(regs, "CNA_FC_DATA_SIZE1", "DMA_CHANNEL")
    c = fld(regs, "CNA_DATA_SIZE1", "DATAIN_CHANNEL")
    if ch != c:
        refuse("dma-size", f"FC_DATA_SIZE1.DMA_CHANNEL={ch} differs from DATAIN_CHANNEL={c}",
               "CNA_FC_DATA_SIZE1", regs.value("CNA_FC_DATA_SIZE1"))
    prec = cna_precision(regs)
    if c < 1 or c % limits.c2(prec):
        refuse("field-range", f"DATAIN_CHANNEL={c} is not a positive multiple of the {prec} "
               f"atom ({limits.c2(prec)} channels) [§6]", "CNA_DATA_SIZE1",
               regs.value("CNA_DATA_SIZE1"))


SURF_STRIDE_BITS = REGISTERS["CNA_DMA_CON2"].field("SURF_STRIDE").width


def plane_height(regs: RegisterSource) -> int:
    """Full plane height Hf from SURF_STRIDE = W*(Hf-4) in 28-bit two's complement; the only
    validated packed-layout form [§7 field notes: MTX, MESA, blob 0x8C / 0xB60 / 0x2F40]."""
    w = fld(regs, "CNA_DATA_SIZE0", "DATAIN_WIDTH")
    h = fld(regs, "CNA_DATA_SIZE0", "DATAIN_HEIGHT")
    ss = fld(regs, "CNA_DMA_CON2", "SURF_STRIDE")
    modulus = 1 << SURF_STRIDE_BITS
    signed = ss - modulus if ss >= modulus // 2 else ss
    if w < 1 or (signed + 4 * w) % w or (signed + 4 * w) // w < max(h, 1):
        refuse("feature-strides", f"SURF_STRIDE={signed} is not W*(H_plane-4) for W={w} and a "
               f"plane height >= the task's H={h}; only that validated form is accepted [§7]",
               "CNA_DMA_CON2", regs.value("CNA_DMA_CON2"))
    return (signed + 4 * w) // w


def rule_line_stride(regs: RegisterSource) -> None:
    """LINE_STRIDE = 4*W: line pitch 16*W bytes (inference in §7 field notes; MTX, MESA,
    blob). GROUP_LINE_OFF=1 (AB's row-major trick) is outside the model."""
    if fld(regs, "CNA_CONV_CON1", "GROUP_LINE_OFF"):
        raise NotModeled("CONV_CON1.GROUP_LINE_OFF=1 (row-major feature layout, semantics "
                         "unknown [§6 'normal layout'])")
    w = fld(regs, "CNA_DATA_SIZE0", "DATAIN_WIDTH")
    ls = fld(regs, "CNA_DMA_CON1", "LINE_STRIDE")
    if ls != 4 * w:
        refuse("feature-strides", f"LINE_STRIDE={ls} but the validated packed form is 4*W={4 * w}",
               "CNA_DMA_CON1", regs.value("CNA_DMA_CON1"))


def rule_surf_stride(regs: RegisterSource) -> None:
    """SURF_STRIDE = W*(Hf-4) with Hf >= H: C1-plane pitch 16*W*Hf bytes [§7]."""
    plane_height(regs)


def rule_feature_grains(regs: RegisterSource) -> None:
    """FEATURE_GRAINS must be at least 2 and fit 10 bits. The TRM suggestion
    (>= y_stride + kernel_h + 1) is NOT enforced: the vendor FC uses H+1 = 2 with a 1x1
    kernel [decoded c1024_h1_oc1001; §7 field notes]."""
    grains = fld(regs, "CNA_CONV_CON2", "FEATURE_GRAINS")
    if grains < 2:
        refuse("feature-grains", f"FEATURE_GRAINS={grains}; every working stream buffers at "
               "least 2 rows (MTX: M+1, blob: H+1) [§7]", "CNA_CONV_CON2",
               regs.value("CNA_CONV_CON2"))


def rule_data_entries(regs: RegisterSource) -> None:
    """CBUF_CON1.DATA_ENTRIES = ceil(W*C*b/64) [§7 table: MTX, MESA, AB; capture 0x70 for
    W=14, C=256 fp16]. A wrong value is where boards fail [§11.5]."""
    prec = cna_precision(regs)
    w = fld(regs, "CNA_DATA_SIZE0", "DATAIN_WIDTH")
    c = fld(regs, "CNA_DATA_SIZE1", "DATAIN_CHANNEL")
    entries = fld(regs, "CNA_CBUF_CON1", "DATA_ENTRIES")
    expect = ceil_div(w * c * limits.BYTES[prec], 64)
    if entries != expect:
        refuse("data-entries", f"DATA_ENTRIES={entries} but ceil(W*C*b/64) = {expect} for "
               f"W={w}, C={c}, {prec}", "CNA_CBUF_CON1", regs.value("CNA_CBUF_CON1"))


def output_dims(regs: RegisterSource) -> tuple[int, int, int]:
    """(W_out, H_out, channels) from CORE DATAOUT_SIZE_0/1 (fields hold n-1)."""
    w = fld(regs, "CORE_DATAOUT_SIZE_0", "DATAOUT_WIDTH") + 1
    h = fld(regs, "CORE_DATAOUT_SIZE_0", "DATAOUT_HEIGHT") + 1
    ch = fld(regs, "CORE_DATAOUT_SIZE_1", "DATAOUT_CHANNEL") + 1
    return w, h, ch


def rule_output_shape(regs: RegisterSource) -> None:
    """CORE, DPU cube and WDMA sizes describe the same output; CNA DATA_SIZE3 counts its
    atoms W_out*H_out [§7 table]."""
    w, h, ch = output_dims(regs)
    checks = (
        ("DPU_DATA_CUBE_WIDTH", "WIDTH", w - 1),
        ("DPU_DATA_CUBE_HEIGHT", "HEIGHT", h - 1),
        ("DPU_DATA_CUBE_CHANNEL", "CHANNEL", ch - 1),
        ("DPU_WDMA_SIZE_0", "CHANNEL_WDMA", ch - 1),
        ("DPU_WDMA_SIZE_1", "WIDTH_WDMA", w - 1),
        ("DPU_WDMA_SIZE_1", "HEIGHT_WDMA", h - 1),
        ("CNA_DATA_SIZE2", "DATAOUT_WIDTH", w),
        ("CNA_DATA_SIZE3", "DATAOUT_ATOMICS", w * h),
    )
    for name, f, expect in checks:
        try:
            got = fld(regs, name, f)
        except Unavailable:
            continue
        if got != expect:
            refuse("output-shape", f"{name}.{f}={got} but CORE_DATAOUT_SIZE_0/1 give {expect} "
                   f"(output {w}x{h}x{ch})", name, regs.value(name))


def rule_output_channels(regs: RegisterSource) -> None:
    """Output channels cover the kernels: WEIGHT_KERNELS <= channels, ORIG_CHANNEL <= CHANNEL,
    channels a whole number of output atoms [§6: blob 1001 kernels -> 1008 channels]."""
    _, _, ch = output_dims(regs)
    kernels = fld(regs, "CNA_WEIGHT_SIZE2", "WEIGHT_KERNELS")
    if kernels > ch:
        refuse("output-channels", f"WEIGHT_KERNELS={kernels} > output channels {ch}",
               "CORE_DATAOUT_SIZE_1", regs.value("CORE_DATAOUT_SIZE_1"))
    orig = fld(regs, "DPU_DATA_CUBE_CHANNEL", "ORIG_CHANNEL")
    if orig + 1 > ch:
        refuse("output-channels", f"ORIG_CHANNEL+1={orig + 1} > CHANNEL+1={ch}",
               "DPU_DATA_CUBE_CHANNEL", regs.value("DPU_DATA_CUBE_CHANNEL"))
    try:
        out = dpu_out_precision(regs)
    except Unavailable:   # partial field set without DPU_DATA_FORMAT
        return
    atom = limits.ATOM_BYTES // limits.BYTES[out] if out in limits.BYTES else 1
    if ch % atom:
        refuse("output-channels", f"{ch} output channels is not a whole number of {out} atoms "
               f"({atom} channels)", "CORE_DATAOUT_SIZE_1", regs.value("CORE_DATAOUT_SIZE_1"))


def rule_surface_add(regs: RegisterSource) -> None:
    """SURFACE_ADD = DST_SURF_STRIDE * S and BS_OW_CFG SIZE_E_0/1/2 = S-1 (the S rule, an
    empirical fit [§7]); DST_SURF_STRIDE must hold a whole W_out*H_out plane."""
    prec = cna_precision(regs)
    stride = fld(regs, "DPU_DST_SURF_STRIDE", "DST_SURF_STRIDE")
    add = fld(regs, "DPU_SURFACE_ADD", "SURF_ADD")
    try:
        out = dpu_out_precision(regs)
    except Unavailable:   # partial field set: accept any output precision modeled for `prec`
        fits = [o for o in _MODELED_OUTPUTS[prec] if add == stride * surface_multiplier(prec, o)]
        out = fits[0] if fits else _MODELED_OUTPUTS[prec][0]
    if out not in limits.BYTES or prec not in limits.KERNEL_GROUP:
        raise NotModeled(f"S rule for {prec} in, {out} out")
    s = surface_multiplier(prec, out)
    if add != stride * s:
        refuse("surface-add", f"SURF_ADD={add} but DST_SURF_STRIDE {stride} x S={s} "
               f"({prec} in, {out} out) = {stride * s}", "DPU_SURFACE_ADD",
               regs.value("DPU_SURFACE_ADD"))
    try:
        w, h, _ = output_dims(regs)
    except Unavailable:
        w = h = 0
    if stride < w * h:
        refuse("dst-surf-stride", f"DST_SURF_STRIDE={stride} atoms is smaller than one output "
               f"plane ({w}x{h} = {w * h} atoms): planes would overlap",
               "DPU_DST_SURF_STRIDE", regs.value("DPU_DST_SURF_STRIDE"))
    try:
        ow = regs.value("DPU_BS_OW_CFG")
    except Unavailable:
        return
    for f in ("SIZE_E_0", "SIZE_E_1", "SIZE_E_2"):
        got = REGISTERS["DPU_BS_OW_CFG"].field(f).extract(ow)
        if got != s - 1:
            refuse("surface-add", f"BS_OW_CFG.{f}={got} but S-1={s - 1} for {prec} in, {out} out",
                   "DPU_BS_OW_CFG", ow)


def rule_alignment(regs: RegisterSource) -> None:
    """Data addresses are 16-byte aligned (atoms are 16 B; MTX/MESA fields [31:4]) [§7, §12.4]."""
    for name in ("CNA_FEATURE_DATA_ADDR", "CNA_DCOMP_ADDR0", "DPU_DST_BASE_ADDR"):
        v = regs.value(name)
        if v % limits.DATA_ALIGN:
            refuse("alignment", f"address 0x{v:08X} is not {limits.DATA_ALIGN}-byte aligned",
                   name, v)


def rule_conv_mode(regs: RegisterSource) -> None:
    """CONV_MODE 1 and 2 are reserved (0 direct, 3 depthwise) [TRM CNA CONV_CON1]."""
    mode = fld(regs, "CNA_CONV_CON1", "CONV_MODE")
    if mode in (1, 2):
        refuse("field-range", f"CONV_CON1.CONV_MODE={mode} is reserved (0 direct, 3 depthwise) "
               "[TRM]", "CNA_CONV_CON1", regs.value("CNA_CONV_CON1"))


def rule_conv_strides(regs: RegisterSource) -> None:
    """Convolution strides start at 1 [TRM CNA CONV_CON3]."""
    for f in ("CONV_X_STRIDE", "CONV_Y_STRIDE"):
        if fld(regs, "CNA_CONV_CON3", f) < 1:
            refuse("field-range", f"CONV_CON3.{f}=0; strides start at 1", "CNA_CONV_CON3",
                   regs.value("CNA_CONV_CON3"))


CONV_RULES: tuple[Callable[[RegisterSource], None], ...] = (
    rule_conv_mode,
    rule_conv_strides,
    rule_cbuf_banks,
    rule_cbuf_input,
    rule_weight_size,
    rule_dma_size,
    rule_line_stride,
    rule_surf_stride,
    rule_feature_grains,
    rule_data_entries,
    rule_output_shape,
    rule_output_channels,
    rule_surface_add,
    rule_alignment,
)


# --- validating a partial decoded field set (captures/decoded/*.json) ---------------------------
@dataclass
class FieldSet:
    """A partial register set, e.g. one ``body_rows`` entry of a decoded capture."""

    values: Mapping[str, int]

    def value(self, name: str) -> int:
        try:
            return int(self.values[name])
        except KeyError:
            raise Unavailable(name) from None


@dataclass
class Report:
    checked: list[str] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)
    violations: list[Violation] = field(default_factory=list)
    not_modeled: list[str] = field(default_factory=list)


def validate_fields(values: Mapping[str, int]) -> Report:
    """Run every conv rule over a partial register set; rules missing a register are skipped."""
    values = {k: int(v) for k, v in values.items() if v is not None}
    regs = FieldSet(values)
    report = Report()
    for name, v in values.items():
        try:
            check_reserved(name, v)
        except TaskRefused as exc:
            report.violations.append(exc.violation)
    report.checked.append("field-range")
    for rule in CONV_RULES:
        try:
            rule(regs)
            report.checked.append(rule.__name__)
        except Unavailable:
            report.skipped.append(rule.__name__)
        except TaskRefused as exc:
            report.violations.append(exc.violation)
        except NotModeled as exc:
            report.not_modeled.append(f"{rule.__name__}: {exc}")
    return report
