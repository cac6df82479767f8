"""Split a matmul into hardware tasks: K chunks, N ranges per core and per task, M tiles.

Invariants: one task takes at most ``MAX_TASK_K`` channels and its whole input must fit its
data banks beside a weight bank that holds one whole kernel group; N is split across cores
first, then per task to at most 8192 kernels; M tiles are at most 1022 rows; at most 4095
tasks per core, else an error; decode rows (M <= 16) may split K inside a weight chunk,
one kernel group per task, where the model prices it cheaper (``group_split``); K chunking
depends on (K, dtype, envelope) only, so a weight is packed once whatever M is; every rule is bounded by the envelope the plan is
made in (``PROVEN`` by default, ``hw.envelope``). Each rule with its source:
docs/compiler.md "Tiling"."""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

from ggml_rknpu.compiler.shape import MatmulShape
from ggml_rknpu.hw import limits
from ggml_rknpu.hw.alignment import align_up, ceil_div
from ggml_rknpu.hw.envelope import PROVEN, Envelope, by_name

MAX_TASK_K = limits.SDK_MAX_K
MAX_TASK_N = limits.MAX_DPU_CUBE                      # 8192 (13-bit field holds N-1)
MAX_TASK_M = limits.MAX_FEATURE_GRAINS - 1            # 1022: FEATURE_GRAINS = M_t + 1
SDK_SPLIT_K = 8192     # the SDK splits B into ceil(K/8192) segments beyond this [docs/rknn-toolkit.md §4.4]
FEATURE_GRAINS_EXTRA = 1   # FEATURE_GRAINS = M_t + 1 [§7, MTX]; emit.py writes it
MIN_CHUNK_K = 1024     # OUR CHOICE: a shortest chunk whose fp16 kernel group fills one bank
#                        (16*1024*2 B = 32 KiB); bounds the partial C regions the host sums
TUNE_M, TUNE_N = 512, 4096   # OUR CHOICE: the reference prefill the chunk count is tuned on
CHUNK_SLACK = 0.10     # OUR CHOICE: the fewest chunks within 10% of the best modeled time,
#                        because the model does not price the host's sum of the partials
assert MAX_TASK_M <= limits.MAX_DATAIN_HEIGHT
assert MAX_TASK_K * 2 <= limits.MAX_KERNEL_BYTES      # one fp16 kernel fits one bank
# a whole kernel group of a maximal chunk leaves >= 1 data bank (16*10240*2 = 10 banks)
assert max(g * MAX_TASK_K * limits.BYTES[d] for d, g in limits.KERNEL_GROUP.items()) \
    <= (limits.CBUF_BANKS - 1) * limits.CBUF_BANK_BYTES


@dataclass(frozen=True)
class KChunk:
    index: int
    k0: int        # first (padded) input channel
    size: int      # channels in the chunk, a multiple of 32


@dataclass(frozen=True)
class TaskTile:
    core: int
    m0: int
    m: int         # rows (DATAIN_HEIGHT)
    n0: int        # first kernel, a multiple of the kernel group
    n: int         # kernels, a multiple of the kernel group
    chunk: KChunk  # the K range the task computes; its partial C region is chunk.index
    data_banks: int
    block: KChunk | None = None   # the weight layout chunk holding the task's weights, when
    #                               the task computes only part of it (one kernel group: split K
    #                               of a decode pass, ``group_split``); None: ``chunk`` itself

    @property
    def weight_banks(self) -> int:
        return limits.CBUF_BANKS - self.data_banks


@dataclass(frozen=True)
class Tiling:
    shape: MatmulShape
    chunks: tuple[KChunk, ...]      # the weight layout's K chunks (``layout.pack_b``)
    tasks: tuple[TaskTile, ...]     # grouped by core, in execution order
    cores_used: int
    partials: tuple[KChunk, ...] = ()   # the K ranges with a C region each; () = ``chunks``

    @property
    def k_splits(self) -> int:
        """Partial C regions the host sums (``layout.unpack_c``)."""
        return len(self.partials or self.chunks)


def k_chunks(K: int, dtype: str, envelope: Envelope | str = PROVEN) -> tuple[KChunk, ...]:
    """Balanced chunks of whole 32-channel atoms (whole ``k_chunk_multiple`` units when K
    is split), each within the envelope's per-task K, counted as the module doc says.
    Depends only on (K, dtype, envelope) so the native B layout of a weight does not
    depend on M."""
    if dtype not in limits.KERNEL_GROUP:
        raise ValueError(f"unsupported matmul input dtype {dtype!r}; supported: {sorted(limits.KERNEL_GROUP)}")
    if not isinstance(K, int) or isinstance(K, bool) or K < 1:
        raise ValueError(f"matmul K must be a positive int, got {K!r}")
    return _tuned_chunks(K, dtype, by_name(envelope))


def _balanced_chunks(K: int, parts: int, unit: int = limits.K_ALIGN) -> tuple[KChunk, ...]:
    """K in about ``parts`` balanced runs of whole ``unit``-channel blocks (fewer when the
    blocks run out: every chunk is non-empty); the last chunk ends at Kp (a multiple of 32)."""
    Kp = align_up(K, limits.K_ALIGN)
    per = ceil_div(ceil_div(Kp, unit), parts) * unit
    return tuple(KChunk(i, k0, min(per, Kp - k0)) for i, k0 in enumerate(range(0, Kp, per)))


@lru_cache(maxsize=512)
def _tuned_chunks(K: int, dtype: str, envelope: Envelope) -> tuple[KChunk, ...]:
    Kp = align_up(K, limits.K_ALIGN)
    if Kp <= envelope.max_single_k[dtype]:
        return _balanced_chunks(K, 1)
    unit = envelope.k_chunk_multiple
    longest = envelope.max_chunk_k[dtype] // unit * unit
    fewest = ceil_div(Kp, longest)
    most = max(fewest, ceil_div(Kp, MIN_CHUNK_K))
    candidates = {_balanced_chunks(K, parts, unit) for parts in range(fewest, most + 1)}
    candidates = {c for c in candidates if max(ch.size for ch in c) <= envelope.max_chunk_k[dtype]}
    seconds = {chunks: _reference_seconds(K, dtype, chunks, envelope) for chunks in candidates}
    best = min(seconds.values())
    near_best = [chunks for chunks, t in seconds.items() if t <= best * (1 + CHUNK_SLACK)]
    return min(near_best, key=lambda chunks: (len(chunks), seconds[chunks]))


def _reference_seconds(K: int, dtype: str, chunks: tuple[KChunk, ...], envelope: Envelope) -> float:
    """Modeled time of the reference prefill TUNE_M x K x TUNE_N on one core with these
    chunks (the priced tasks are exactly what ``_tile`` emits)."""
    from ggml_rknpu.cost.model import TaskWork, Workload, modeled_time

    out = "int32" if dtype == "int8" else "fp32"
    tiling = _tile(MatmulShape(TUNE_M, K, TUNE_N, dtype, out), 1, chunks, envelope)
    works = tuple(TaskWork(t.core, t.m, t.chunk.size, t.n, dtype, limits.BYTES[out]) for t in tiling.tasks)
    return modeled_time(Workload(works)).total_s


def _split(total: int, parts: int) -> list[tuple[int, int]]:
    """``parts`` contiguous balanced (start, length) ranges of ``total`` units."""
    base, extra = divmod(total, parts)
    out, start = [], 0
    for i in range(parts):
        length = base + (1 if i < extra else 0)
        out.append((start, length))
        start += length
    return out


def max_task_rows(chunk_size: int, shape: MatmulShape, envelope: Envelope = PROVEN) -> int:
    """Largest M_t whose input fits the data banks left after one kernel group, the group
    filling at most the envelope's share of its banks, rows sized by its entry rule, and
    FEATURE_GRAINS = M_t + 1 within its bound [module doc]."""
    b = shape.in_bytes
    group_banks = envelope.weight_banks_for(shape.kernel_group * chunk_size * b)
    data_banks = min(limits.MAX_DATA_BANKS, limits.CBUF_BANKS - group_banks)
    rows = data_banks * limits.CBUF_BANK_BYTES // envelope.row_bytes(chunk_size, b)
    return min(rows, MAX_TASK_M, envelope.max_feature_grains - FEATURE_GRAINS_EXTRA)


def data_banks_for(rows: int, chunk_size: int, in_bytes: int, envelope: Envelope = PROVEN) -> int:
    """DATA_BANK = ceil(H*W*row bytes / 32 KiB) [§7 CBUF_CON0], a row sized by the
    envelope's entry rule (bytes in EXTENDED, whole 64-byte entries in PROVEN)."""
    return ceil_div(rows * envelope.row_bytes(chunk_size, in_bytes), limits.CBUF_BANK_BYTES)


def tile(shape: MatmulShape, cores: int = 1, envelope: Envelope | str = PROVEN) -> Tiling:
    """The task list for ``shape`` on up to ``cores`` cores, no more than the envelope
    allows (pure, deterministic)."""
    if not 1 <= cores <= limits.N_CORES:
        raise ValueError(f"cores must be 1..{limits.N_CORES}, got {cores}")
    envelope = by_name(envelope)
    plain = _tile(shape, min(cores, envelope.max_cores), k_chunks(shape.K, shape.dtype, envelope), envelope)
    if shape.M > GROUP_SPLIT_MAX_ROWS or not _restreams(plain):
        return plain
    return _cheapest_group_split(plain, envelope)


def _core_ranges(shape: MatmulShape, cores: int) -> list[tuple[tuple[int, int], tuple[int, int]]]:
    """Per core ((m0, rows), (n0, kernels)): N ranges of whole kernel groups when N has a
    group per core, else M ranges [module doc, Cores]."""
    g = shape.kernel_group
    groups = shape.Np // g
    if groups >= cores:
        return [((0, shape.M), (s * g, n * g)) for s, n in _split(groups, cores)]
    if shape.M >= cores:
        return [((s, n), (0, shape.Np)) for s, n in _split(shape.M, cores)]
    used = max(groups, shape.M)
    if groups >= shape.M:
        return [((0, shape.M), (s * g, n * g)) for s, n in _split(groups, used)]
    return [((s, n), (0, shape.Np)) for s, n in _split(shape.M, used)]


def _check_task_count(shape: MatmulShape, core: int, count: int) -> None:
    if count > limits.MAX_TASKS_PER_SUBMIT:
        raise ValueError(
            f"matmul {shape.M}x{shape.K}x{shape.N} needs {count} tasks on core {core}, "
            f"more than the {limits.MAX_TASKS_PER_SUBMIT} one hardware run can chain; "
            "split the call along M"
        )


def _tile(shape: MatmulShape, cores: int, chunks: tuple[KChunk, ...], envelope: Envelope) -> Tiling:
    g = shape.kernel_group
    m_max = max_task_rows(max(c.size for c in chunks), shape, envelope)
    max_n = min(MAX_TASK_N, envelope.max_task_n[shape.dtype])
    core_ranges = _core_ranges(shape, cores)
    tasks: list[TaskTile] = []
    for core, ((cm0, cm), (cn0, cn)) in enumerate(core_ranges):
        n_tiles = _split(cn // g, ceil_div(cn, max_n))
        m_tiles = _split(cm, ceil_div(cm, m_max))
        core_tasks = [
            TaskTile(core, cm0 + m0, m, cn0 + n0 * g, n * g, chunk,
                     data_banks_for(m, chunk.size, shape.in_bytes, envelope))
            for chunk in chunks
            for n0, n in n_tiles
            for m0, m in m_tiles
        ]
        _check_task_count(shape, core, len(core_tasks))
        tasks.extend(core_tasks)
    return Tiling(shape, chunks, tuple(tasks), len(core_ranges))


# --- split K of a decode pass over the weights as packed ------------------------------
GROUP_SPLIT_MAX_ROWS = 16
# OUR CHOICE: decode passes (M <= 16, one MAC atom of rows [cost.model M_ATOM]) are the
# shapes where a whole kernel group of a long K leaves too few data banks for their rows
# (fp16 K in (6144, 8192]: 8-11 rows at full weight fill, 2 at the proven 8/11), so the
# pass runs as M tiles that each re-stream the core's weights. Prefill is not evaluated
# here (its many M tiles would become thousands of one-group tasks).


def _restreams(tiling: Tiling) -> bool:
    """Whether some core runs one weight range for several M tiles (re-streaming it)."""
    return len({(t.core, t.chunk.index, t.n0) for t in tiling.tasks}) < len(tiling.tasks)


def group_split(plain: Tiling, parts: int, envelope: Envelope) -> Tiling | None:
    """``plain`` with each weight chunk's K cut into ``parts`` runs of whole
    ``k_chunk_multiple`` channels, one task per (kernel group, run, M tile); None when the
    runs cannot be cut or a core would need more tasks than one run chains.

    WHY this needs no new weight layout: a chunk stores each kernel group as one run
    ``(Kc/32, g, 32)`` [layout.py], so the channels [k0, k0 + kc) of one group are the
    contiguous ``(kc/32, g, 32)`` run a task of a chunk of size kc reads (WEIGHT_BYTES =
    kc x b x g from CNA_DCOMP_ADDR0 [§7]); several groups of a sub-range are not contiguous,
    hence one group per task. Each run writes its own partial C region, summed on the host
    like any K split; the weights are packed once whatever M is, so M = 1 programs (and the
    golden streams) are unchanged."""
    shape = plain.shape
    g = shape.kernel_group
    unit = envelope.k_chunk_multiple
    pieces = [(block, run) for block in plain.chunks for run in _balanced_chunks(block.size, parts, unit)]
    if len(pieces) == len(plain.chunks):
        return None
    partials = tuple(KChunk(i, block.k0 + run.k0, run.size) for i, (block, run) in enumerate(pieces))
    owners = [block for block, _run in pieces]
    m_max = max_task_rows(max(p.size for p in partials), shape, envelope)
    tasks: list[TaskTile] = []
    for core, ((cm0, cm), (cn0, cn)) in enumerate(_core_ranges(shape, plain.cores_used)):
        m_tiles = _split(cm, ceil_div(cm, m_max))
        core_tasks = [
            TaskTile(core, cm0 + m0, m, cn0 + j * g, g, part,
                     data_banks_for(m, part.size, shape.in_bytes, envelope), block)
            for block in plain.chunks
            for j in range(cn // g)
            for part, owner in zip(partials, owners) if owner is block
            for m0, m in m_tiles
        ]
        if len(core_tasks) > limits.MAX_TASKS_PER_SUBMIT:
            return None
        tasks.extend(core_tasks)
    return Tiling(shape, plain.chunks, tuple(tasks), plain.cores_used, partials)


def modeled_seconds(tiling: Tiling, envelope: Envelope) -> float:
    """Modeled time (``cost.model``) of ``tiling``'s tasks and submits, with one submit per
    vendor PC chain of the envelope (the rknpu rule; rocket jobs chain further)."""
    from ggml_rknpu.cost.model import TaskWork, Workload, modeled_time

    shape = tiling.shape
    # C is written in the output precision, fp32 for the partials of a split (layout.partial_dtype)
    out_bytes = limits.BYTES[shape.out] if tiling.k_splits == 1 else 4
    works = tuple(TaskWork(t.core, t.m, t.chunk.size, t.n, shape.dtype, out_bytes) for t in tiling.tasks)
    per_core: dict[int, int] = {}
    for t in tiling.tasks:
        per_core[t.core] = per_core.get(t.core, 0) + 1
    submits = max(ceil_div(n, envelope.max_chain_tasks[shape.dtype]) for n in per_core.values())
    return modeled_time(Workload(works, submits=submits)).total_s


def _cheapest_group_split(plain: Tiling, envelope: Envelope) -> Tiling:
    """Among ``plain`` and its group splits into 2, 3, ... runs (up to the first that needs
    no re-streaming), the fewest runs within ``CHUNK_SLACK`` of the least modeled time:
    the model does not price the host's sum of the partials."""
    options = [plain]
    for parts in range(2, ceil_div(max(c.size for c in plain.chunks), envelope.k_chunk_multiple) + 1):
        split = group_split(plain, parts, envelope)
        if split is None:
            break
        options.append(split)
        if not _restreams(split):
            break
    seconds = [modeled_seconds(t, envelope) for t in options]
    best = min(seconds)
    return next(t for t, s in zip(options, seconds) if s <= best * (1 + CHUNK_SLACK))
