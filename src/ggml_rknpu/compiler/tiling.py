"""Split a matmul into hardware tasks: K chunks, N ranges per core and per task, M tiles.

Invariants: one task takes at most ``MAX_TASK_K`` channels and its whole input must fit its
data banks beside a weight bank that holds one whole kernel group; N is split across cores
first, then per task to at most 8192 kernels; M tiles are at most 1022 rows; at most 4095
tasks per core, else an error; K chunking depends on (K, dtype, envelope) only, so a
weight is packed once whatever M is; every rule is bounded by the envelope the plan is
made in (``PROVEN`` by default, ``hw.envelope``). Each rule with its source:
docs/compiler.md "Tiling"."""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

from ggml_rknpu.compiler.shape import MatmulShape
from ggml_rknpu.hw import limits
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


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


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
    chunk: KChunk
    data_banks: int

    @property
    def weight_banks(self) -> int:
        return limits.CBUF_BANKS - self.data_banks


@dataclass(frozen=True)
class Tiling:
    shape: MatmulShape
    chunks: tuple[KChunk, ...]
    tasks: tuple[TaskTile, ...]     # grouped by core, in execution order
    cores_used: int

    @property
    def k_splits(self) -> int:
        return len(self.chunks)


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
    Kp = ceil_div(K, limits.K_ALIGN) * limits.K_ALIGN
    per = ceil_div(ceil_div(Kp, unit), parts) * unit
    return tuple(KChunk(i, k0, min(per, Kp - k0)) for i, k0 in enumerate(range(0, Kp, per)))


@lru_cache(maxsize=512)
def _tuned_chunks(K: int, dtype: str, envelope: Envelope) -> tuple[KChunk, ...]:
    Kp = ceil_div(K, limits.K_ALIGN) * limits.K_ALIGN
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
    return _tile(shape, min(cores, envelope.max_cores), k_chunks(shape.K, shape.dtype, envelope), envelope)


def _tile(shape: MatmulShape, cores: int, chunks: tuple[KChunk, ...], envelope: Envelope) -> Tiling:
    g = shape.kernel_group
    groups = shape.Np // g
    m_max = max_task_rows(max(c.size for c in chunks), shape, envelope)
    max_n = min(MAX_TASK_N, envelope.max_task_n[shape.dtype])

    if groups >= cores:
        core_ranges = [((0, shape.M), (s * g, n * g)) for s, n in _split(groups, cores)]
    elif shape.M >= cores:
        core_ranges = [((s, n), (0, shape.Np)) for s, n in _split(shape.M, cores)]
    else:
        used = max(groups, shape.M)
        if groups >= shape.M:
            core_ranges = [((0, shape.M), (s * g, n * g)) for s, n in _split(groups, used)]
        else:
            core_ranges = [((s, n), (0, shape.Np)) for s, n in _split(shape.M, used)]

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
        if len(core_tasks) > limits.MAX_TASKS_PER_SUBMIT:
            raise ValueError(
                f"matmul {shape.M}x{shape.K}x{shape.N} needs {len(core_tasks)} tasks on core {core}, "
                f"more than the {limits.MAX_TASKS_PER_SUBMIT} one hardware run can chain; "
                "split the call along M"
            )
        tasks.extend(core_tasks)
    return Tiling(shape, chunks, tuple(tasks), len(core_ranges))
