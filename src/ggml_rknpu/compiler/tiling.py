"""Split a matmul into hardware tasks: K chunks, N ranges per core and per task, M tiles.

Rules, each with its source:

* **K** -- one task takes at most ``MAX_TASK_K = 10240`` channels, the SDK's own matmul
  K limit [SDK rknn_matmul_api.h; npu-programming.md §9; rknn-toolkit.md]. This also
  keeps one kernel's weights within one CBUF bank (Kp*b <= 32 KiB [§9, MTX check]) and a
  whole kernel group within 10 of the 12 banks (16*10240*2 = 32*10240*1 = 10 banks; that the
  SDK limit is chosen for this is our *inference*). Longer K is cut into balanced
  chunks of whole 32-channel atoms; each chunk's fp32/int32 partial result lands in its
  own C region and the host sums them (``layout.unpack_c``) -- there is no proven on-NPU
  accumulation across tasks [§9]. Chunking depends on (K, dtype) only, so weights are
  packed once whatever M is.
* **N** -- split across cores first (contiguous kernel-group ranges; no automatic
  intra-op split exists [§9]), then per task to <= 8192 kernels: DPU cube channel and WDMA
  channel fields are 13 bits holding N-1 [registers.xml; §9]. Tasks take whole kernel
  groups; unaligned N is zero-padded to the group [§6].
* **M** -- a task's whole input, M_t*Kc*b bytes, must fit its DATA_BANK banks, and
  DATA_BANK + WEIGHT_BANK = 12 [§7, §9]. We keep WEIGHT_BANK large enough for one whole
  kernel group (g*Kc*b bytes). That is a *guess* on the safe side: the golden and blob
  streams all satisfy it [golden; capture c1024_h1_oc1001: WEIGHT_BANK 11], and no public
  stream shows a group split across refills. M_t <= 1022 so that FEATURE_GRAINS = M_t+1
  (MTX's validated value [§7]) fits its 10-bit field.
* **Cores** -- N ranges when N has at least one kernel group per core, else M ranges.
* <= 4095 tasks per core (PC TASK_NUMBER, 12 bits [§3, §9]); more is an error telling the
  caller to split the call.
"""

from __future__ import annotations

from dataclasses import dataclass

from ggml_rknpu.compiler.shape import MatmulShape
from ggml_rknpu.hw import limits

MAX_TASK_K = limits.SDK_MAX_K
MAX_TASK_N = limits.MAX_DPU_CUBE                      # 8192 (13-bit field holds N-1)
MAX_TASK_M = limits.MAX_FEATURE_GRAINS - 1            # 1022: FEATURE_GRAINS = M_t + 1
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


def k_chunks(K: int, dtype: str) -> tuple[KChunk, ...]:
    """Balanced chunks of whole 32-channel atoms, each <= MAX_TASK_K. Depends only on
    (K, dtype) so the native B layout of a weight does not depend on M."""
    if dtype not in limits.KERNEL_GROUP:
        raise ValueError(f"unsupported matmul input dtype {dtype!r}; supported: {sorted(limits.KERNEL_GROUP)}")
    if not isinstance(K, int) or K < 1:
        raise ValueError(f"matmul K must be a positive int, got {K!r}")
    atoms = ceil_div(K, limits.K_ALIGN)
    n = ceil_div(atoms * limits.K_ALIGN, MAX_TASK_K)
    per = ceil_div(atoms, n)
    chunks = []
    for i in range(n):
        a0 = i * per
        chunks.append(KChunk(i, a0 * limits.K_ALIGN, (min(per, atoms - a0)) * limits.K_ALIGN))
    return tuple(chunks)


def _split(total: int, parts: int) -> list[tuple[int, int]]:
    """``parts`` contiguous balanced (start, length) ranges of ``total`` units."""
    base, extra = divmod(total, parts)
    out, start = [], 0
    for i in range(parts):
        length = base + (1 if i < extra else 0)
        out.append((start, length))
        start += length
    return out


def max_task_rows(chunk_size: int, shape: MatmulShape) -> int:
    """Largest M_t whose input fits the data banks left after one kernel group [module doc]."""
    b = shape.in_bytes
    group_banks = ceil_div(shape.kernel_group * chunk_size * b, limits.CBUF_BANK_BYTES)
    data_banks = min(limits.MAX_DATA_BANKS, limits.CBUF_BANKS - group_banks)
    rows = data_banks * limits.CBUF_BANK_BYTES // (chunk_size * b)
    return min(rows, MAX_TASK_M)


def data_banks_for(rows: int, chunk_size: int, in_bytes: int) -> int:
    """DATA_BANK = ceil(H*W*Kc*b / 32 KiB) [§7 CBUF_CON0]."""
    return ceil_div(rows * chunk_size * in_bytes, limits.CBUF_BANK_BYTES)


def plan(shape: MatmulShape, cores: int = 1) -> Tiling:
    """The task list for ``shape`` on up to ``cores`` cores (pure, deterministic)."""
    if not 1 <= cores <= limits.N_CORES:
        raise ValueError(f"cores must be 1..{limits.N_CORES}, got {cores}")
    g = shape.kernel_group
    groups = shape.Np // g
    chunks = k_chunks(shape.K, shape.dtype)
    m_max = max_task_rows(max(c.size for c in chunks), shape)

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
        n_tiles = _split(cn // g, ceil_div(cn, MAX_TASK_N))
        m_tiles = _split(cm, ceil_div(cm, m_max))
        core_tasks = [
            TaskTile(core, cm0 + m0, m, cn0 + n0 * g, n * g, chunk,
                     data_banks_for(m, chunk.size, shape.in_bytes))
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
