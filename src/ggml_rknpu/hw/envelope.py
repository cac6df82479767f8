"""The proven envelope: the ranges of every field that streams which really ran on an RK3588
cover, as data with their public sources, and the task fields decoded from regcmd words,
so anything the compiler emits can be checked against it.

Invariants: the compiler plans inside ``PROVEN`` by default; ``EXTENDED`` (what the field
widths and the CBUF size allow) is opt-in, field by field (``Envelope.widen``), and the
``rknpu selftest`` ladder records which widenings a board has passed. Why and the sources
(golden streams, the vendor runtime's captures, Mesa's rocket): docs/envelope.md."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from fractions import Fraction

from ggml_rknpu.hw import limits
from ggml_rknpu.hw.alignment import align_up, ceil_div
from ggml_rknpu.hw.regcmd import Target, decode_word
from ggml_rknpu.hw.registers import BY_OFFSET, REGISTERS

ROCKET_JOB_TIMEOUT_MS = 500
# mainline drivers/accel/rocket/rocket_job.c: JOB_TIMEOUT_MS, the drm_sched timeout of a
# job (all of its tasks); rocket_job_timedout() resets the core and the job's outputs are
# left as they were (rocket_gem.c rocket_ioctl_prep_bo still returns 0).
ROCKET_BOOT_MHZ = 200
# mainline boots the NPU at 200 MHz (gregordinary/ggml-rocket README); jobs are sized at
# this clock so that one that fits here fits at any faster clock.
JOB_SAFE_FRACTION = Fraction(1, 2)   # OUR CHOICE: no job is modeled above half the timeout


@dataclass(frozen=True)
class Envelope:
    """Limits on what one program may contain. Every field is a *bound*; a program is
    inside when every task and chain respects all of them (``violations``)."""

    name: str
    max_cores: int                      # cores one submit uses
    max_chain_tasks: dict[str, int]     # tasks in one vendor PC chain, per input dtype
    max_feature_grains: int             # CNA_CONV_CON2.FEATURE_GRAINS (= task rows + 1)
    max_weight_fill: Fraction           # kernel-group bytes / (WEIGHT_BANK * 32 KiB)
    data_entry_bytes: int               # DATA_BANK covers rows * ceil(Kc*b / this) * this
    k_chunk_multiple: int               # a split K chunk is a multiple of this (the last: any)
    max_chunk_k: dict[str, int]         # DATAIN_CHANNEL of one task, per input dtype
    max_single_k: dict[str, int]        # K up to this runs as one chunk (no split)
    max_task_n: dict[str, int]          # WEIGHT_KERNELS of one task, per input dtype
    max_job_ms: float                   # modeled ms of one rocket job at job_model_mhz
    job_model_mhz: float = ROCKET_BOOT_MHZ  # the NPU clock rocket jobs are sized at

    def __hash__(self) -> int:   # the dict fields are never mutated; envelopes key compile caches
        return hash(tuple(tuple(sorted(v.items())) if isinstance(v, dict) else v
                          for v in dataclasses.astuple(self)))

    def widen(self, name: str | None = None, **fields) -> Envelope:
        """This envelope with some fields taken wider (e.g. ``max_cores=3``)."""
        return dataclasses.replace(self, name=name or f"{self.name}+" + ",".join(sorted(fields)), **fields)

    def row_bytes(self, chunk_k: int, in_bytes: int) -> int:
        """CBUF bytes one row of a task's input takes under this envelope's sizing rule."""
        return align_up(chunk_k * in_bytes, self.data_entry_bytes)

    def weight_banks_for(self, group_bytes: int) -> int:
        """Fewest WEIGHT_BANK banks that hold ``group_bytes`` at no more than max_weight_fill."""
        need = Fraction(group_bytes) / (self.max_weight_fill * limits.CBUF_BANK_BYTES)
        return max(limits.MIN_WEIGHT_BANKS, ceil_div(need.numerator, need.denominator))

    def describe(self) -> str:
        return (f"{self.name}: {self.max_cores} core(s), chains <= {self.max_chain_tasks['fp16']} fp16 / "
                f"{self.max_chain_tasks['int8']} int8 tasks, FEATURE_GRAINS <= {self.max_feature_grains}, "
                f"weight fill <= {float(self.max_weight_fill):.2f}, rocket jobs <= {self.max_job_ms:g} ms modeled")


PROVEN = Envelope(
    name="proven",
    # every vendor capture submits core_mask 0 (the driver picks one core) [capture
    # pw_c256_h14 ioctl log]; the goldens are single-core; raw multi-core submits locked
    # boards in allbilly/rk3588's experiments.
    max_cores=1,
    # longest captured vendor chain: 65 tasks in one submit (capture c576_h19_oc273_s1pvalid,
    # fp16); no int8 stream with more than one task ran under the vendor driver (the
    # int8 goldens are single tasks; Mesa's int8 jobs run on rocket, one task per start).
    max_chain_tasks={"fp16": 65, "int8": 1},
    # golden int8 544x544x4096: FEATURE_GRAINS = 545, the most rows any stream gave one task.
    max_feature_grains=545,
    # golden fp16->fp16 1x8192x8192: one 16-kernel group of 256 KiB in WEIGHT_BANK 11
    # (8/11 = 0.727); the vendor's highest is 0.68 [captures]. Mesa keeps a spare bank.
    max_weight_fill=Fraction(8, 11),
    # DATA_ENTRIES counts 64-byte units of a row (golden, Mesa and the vendor agree);
    # banks are sized for whole entries (an int8 row of an odd number of 32-channel
    # atoms takes a whole extra half-entry).
    data_entry_bytes=64,
    # the vendor's compiler splits K at 512, 768, 1024, 1536 (rknn-toolkit2 exports:
    # 1x8960x1536 fp16 in 6 K tiles, 16x4096x4096 in 1536/1536/1024, 64x1536x8960 in 2x768).
    k_chunk_multiple=256,
    # one task's K: golden fp16 1x8192x8192 (fp16 out), int8 1x4096x4096 and 544x544x4096.
    max_chunk_k={"fp16": 8192, "int8": 4096},
    max_single_k={"fp16": 8192, "int8": 4096},
    # one task's kernels: golden fp16 1x8192x8192, int8 1x4096x4096.
    max_task_n={"fp16": 8192, "int8": 4096},
    max_job_ms=float(ROCKET_JOB_TIMEOUT_MS * JOB_SAFE_FRACTION),
)

EXTENDED = Envelope(
    name="extended",
    max_cores=limits.N_CORES,
    max_chain_tasks={"fp16": limits.MAX_TASKS_PER_SUBMIT, "int8": limits.MAX_TASKS_PER_SUBMIT},
    max_feature_grains=limits.MAX_FEATURE_GRAINS,           # 10-bit field
    max_weight_fill=Fraction(1),
    data_entry_bytes=1,                                     # bytes, as the TRM's CBUF_CON0 text
    k_chunk_multiple=limits.K_ALIGN,
    max_chunk_k={"fp16": limits.SDK_MAX_K, "int8": limits.SDK_MAX_K},
    max_single_k={"fp16": 8192, "int8": 8192},              # the SDK splits B beyond 8192
    max_task_n={"fp16": limits.MAX_DPU_CUBE, "int8": limits.MAX_DPU_CUBE},
    # the rocket timeout is the driver's, not a hardware range: it holds in every envelope
    max_job_ms=float(ROCKET_JOB_TIMEOUT_MS * JOB_SAFE_FRACTION),
)

ENVELOPES = {e.name: e for e in (PROVEN, EXTENDED)}


def by_name(name: str | Envelope) -> Envelope:
    if isinstance(name, Envelope):
        return name
    try:
        return ENVELOPES[name]
    except KeyError:
        raise ValueError(f"unknown envelope {name!r}; choose one of {sorted(ENVELOPES)}") from None


# --- task fields, decoded from regcmd words ------------------------------------------
_DTYPE_OF_CNA = {v: k for k, v in limits.CNA_PRECISION.items()}
_DTYPE_OF_DPU = {v: k for k, v in limits.DPU_PRECISION.items()}


@dataclass(frozen=True)
class TaskFields:
    """What the envelope constrains, read from one task's register writes."""

    dtype: str
    rows: int
    width: int
    chunk_k: int
    kernels: int
    bytes_per_kernel: int
    data_bank: int
    weight_bank: int
    feature_grains: int
    data_entries: int
    a_offset: int            # CNA_FEATURE_DATA_ADDR (a buffer offset when bound at 0)
    c_offset: int            # DPU_DST_BASE_ADDR (likewise)
    out_dtype: str           # DPU_DATA_FORMAT.OUT_PRECISION
    plane_rows: int          # DPU_DST_SURF_STRIDE: the full M of the matmul
    next_addr: int           # PC_BASE_ADDRESS of the tail (0: last of its chain)
    next_amount: int         # PC_REGISTER_AMOUNTS of the tail

    @property
    def group_bytes(self) -> int:
        return min(limits.KERNEL_GROUP[self.dtype], self.kernels) * self.bytes_per_kernel

    @property
    def weight_fill(self) -> Fraction:
        return Fraction(self.group_bytes, max(self.weight_bank, 1) * limits.CBUF_BANK_BYTES)

    @property
    def k0(self) -> int:
        """First input channel of the task's chunk (native A layout, §6)."""
        plane = self.plane_rows * self.width * limits.ATOM_BYTES
        return (self.a_offset // plane) * limits.c2(self.dtype)


def _field(values: dict[int, int], register: str, name: str) -> int:
    reg = REGISTERS[register]
    return reg.field(name).extract(values.get(reg.offset, 0))


def decode_task(words) -> TaskFields:
    """Fields of one task from its words (body and 4-word tail). The last write of a
    register wins, as on the hardware."""
    values: dict[int, int] = {}
    for w in words:
        w = int(w)
        if w == 0:
            continue
        target, value, offset = decode_word(w)
        if target in (Target.MARKER, Target.OP_ENABLE) or offset not in BY_OFFSET:
            continue
        values[offset] = value
    precision = _field(values, "CNA_CONV_CON1", "IN_PRECISION")
    out_precision = _field(values, "DPU_DATA_FORMAT", "OUT_PRECISION")
    return TaskFields(
        dtype=_DTYPE_OF_CNA.get(precision, f"precision{precision}"),
        rows=_field(values, "CNA_DATA_SIZE0", "DATAIN_HEIGHT"),
        width=_field(values, "CNA_DATA_SIZE0", "DATAIN_WIDTH"),
        chunk_k=_field(values, "CNA_DATA_SIZE1", "DATAIN_CHANNEL"),
        kernels=_field(values, "CNA_WEIGHT_SIZE2", "WEIGHT_KERNELS"),
        bytes_per_kernel=_field(values, "CNA_WEIGHT_SIZE1", "WEIGHT_BYTES_PER_KERNEL"),
        data_bank=_field(values, "CNA_CBUF_CON0", "DATA_BANK"),
        weight_bank=_field(values, "CNA_CBUF_CON0", "WEIGHT_BANK"),
        feature_grains=_field(values, "CNA_CONV_CON2", "FEATURE_GRAINS"),
        data_entries=_field(values, "CNA_CBUF_CON1", "DATA_ENTRIES"),
        a_offset=_field(values, "CNA_FEATURE_DATA_ADDR", "FEATURE_BASE_ADDR"),
        c_offset=_field(values, "DPU_DST_BASE_ADDR", "DST_BASE_ADDR"),
        out_dtype=_DTYPE_OF_DPU.get(out_precision, f"precision{out_precision}"),
        plane_rows=_field(values, "DPU_DST_SURF_STRIDE", "DST_SURF_STRIDE"),
        next_addr=_field(values, "PC_BASE_ADDRESS", "PC_SOURCE_ADDR") << 4,
        next_amount=_field(values, "PC_REGISTER_AMOUNTS", "PC_DATA_AMOUNT"),
    )


def task_violations(t: TaskFields, env: Envelope) -> list[str]:
    """Every way one task leaves ``env`` (empty: inside)."""
    out = []
    if t.dtype not in env.max_chunk_k:
        return [f"input precision {t.dtype} is outside every envelope"]
    if t.feature_grains > env.max_feature_grains:
        out.append(f"FEATURE_GRAINS {t.feature_grains} > {env.max_feature_grains}")
    if t.weight_fill > env.max_weight_fill:
        out.append(f"weight group {t.group_bytes} B fills {float(t.weight_fill):.3f} of WEIGHT_BANK {t.weight_bank}"
                   f" > {float(env.max_weight_fill):.3f}")
    need = t.rows * t.width * env.row_bytes(t.chunk_k, limits.BYTES[t.dtype])
    if need > t.data_bank * limits.CBUF_BANK_BYTES:
        out.append(f"input {need} B (rows x {env.data_entry_bytes}-B entries) > DATA_BANK {t.data_bank}")
    if t.data_bank + t.weight_bank != limits.CBUF_BANKS:
        out.append(f"DATA_BANK {t.data_bank} + WEIGHT_BANK {t.weight_bank} != {limits.CBUF_BANKS}")
    if t.chunk_k > env.max_chunk_k[t.dtype]:
        out.append(f"K chunk {t.chunk_k} > {env.max_chunk_k[t.dtype]} ({t.dtype})")
    if t.kernels > env.max_task_n[t.dtype]:
        out.append(f"{t.kernels} kernels in one task > {env.max_task_n[t.dtype]} ({t.dtype})")
    return out


def chain_violations(chain: list[TaskFields], env: Envelope, abi: str) -> list[str]:
    """Limits on one chain (one vendor submit's task list of one core) beyond its tasks."""
    out = []
    if abi == "rknpu" and chain and len(chain) > env.max_chain_tasks[chain[0].dtype]:
        out.append(f"{len(chain)} tasks in one PC chain > {env.max_chain_tasks[chain[0].dtype]} ({chain[0].dtype})")
    return out


def program_k_violations(tasks: list[TaskFields], env: Envelope) -> list[str]:
    """K chunk sizes: a matmul split along K uses chunks of a multiple of k_chunk_multiple
    (its last chunk may be shorter); a matmul in one chunk takes any K up to max_single_k."""
    if not tasks:
        return []
    k_total = max(t.k0 + t.chunk_k for t in tasks)
    starts = {t.k0 for t in tasks}
    dtype = tasks[0].dtype
    if len(starts) == 1:
        return [] if k_total <= env.max_single_k[dtype] else [f"K {k_total} in one chunk > {env.max_single_k[dtype]}"]
    return [f"K chunk {t.chunk_k} at k0={t.k0} is not a multiple of {env.k_chunk_multiple}"
            for t in tasks if t.k0 + t.chunk_k != k_total and t.chunk_k % env.k_chunk_multiple]


def walk_chain(words, start_word: int, fetch_words: int) -> list[TaskFields]:
    """The tasks of one PC chain as the hardware reaches them: fetch ``fetch_words`` from
    ``start_word``, then follow each tail's PC_BASE_ADDRESS / PC_REGISTER_AMOUNTS until a
    (0, 0) tail [docs/npu-programming.md §2, §11]. ``words`` must be bound with the regcmd
    buffer at address 0, so tail addresses are byte offsets into ``words``."""
    from ggml_rknpu.hw.regcmd import words_for_amount

    tasks: list[TaskFields] = []
    while True:
        if len(tasks) > limits.MAX_TASKS_PER_SUBMIT:
            raise ValueError("chain does not end within 4095 tasks (a tail loop?)")
        task = decode_task(words[start_word: start_word + fetch_words])
        tasks.append(task)
        if task.next_addr == 0:
            return tasks
        start_word, fetch_words = task.next_addr // 8, words_for_amount(task.next_amount)
