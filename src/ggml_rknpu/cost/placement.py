"""Where a matmul runs, by cost: on the NPU, on the host (ggml-cpu), or split along N
with both at once, whichever the models say finishes first. A pure decision: it reads
modeled times and returns a ``Choice``; nothing here runs anything.

Invariants: the choice is the argmin of the three times (``npu_s``, ``host_s``,
``split_s``); a split runs ``host_rows`` of the N output rows on the host and the rest on
the NPU, the boundary a multiple of ``SPLIT_ALIGN``, chosen so both finish together, and
its time is never below the shared DRAM's ceiling for the two streams together (one
DRAM serves CPU and NPU: ``cost.model.dram_bandwidth``). Decisions are made per M bucket
at the bucket's largest M (``BUCKET_M``). Why: docs/placement.md."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from ggml_rknpu.cost import cpu
from ggml_rknpu.cost.model import (
    IN_BYTES,
    OWN_DRIVER,
    VENDOR_NPU_MHZ,
    dram_bandwidth,
    modeled_time,
    vendor_style_workload,
)
from ggml_rknpu.hw.alignment import ceil_div

NPU = "npu"
HOST = "host"
SPLIT = "split"
PLACEMENTS = (NPU, HOST, SPLIT)

BUCKETS = ("1", "2-4", "5-16", "prefill")
BUCKET_M = {"1": 1, "2-4": 4, "5-16": 16, "prefill": 512}   # the M each bucket is decided at
SPLIT_ALIGN = 64    # host/NPU boundary: a multiple of every NPU kernel group and CPU repack row count
SPLIT_NEIGHBOURS = 4   # boundaries priced either side of the crossing


def bucket(M: int) -> str:
    """The M bucket of a matmul of ``M`` rows (decode 1, 2-4 speculative/slots, 5-16, prefill)."""
    if M < 1:
        raise ValueError(f"M must be >= 1, got {M}")
    return "1" if M == 1 else "2-4" if M <= 4 else "5-16" if M <= 16 else "prefill"


@dataclass(frozen=True)
class Choice:
    """A placement and the modeled times it was chosen from (``split_s`` None: no split
    was possible or allowed)."""

    where: str
    npu_s: float
    host_s: float
    split_s: float | None = None
    host_rows: int = 0        # N rows on the host (all of N for "host", 0 for "npu")

    @property
    def seconds(self) -> float:
        return {NPU: self.npu_s, HOST: self.host_s}.get(self.where, self.split_s or 0.0)


def choose(N: int, npu_s: Callable[[int], float], host_s: Callable[[int], float],
           stream_bytes: Callable[[int, int], float] | None = None, *, allow_split: bool = True,
           dram_bytes_s: float = 0.0) -> Choice:
    """The fastest placement of N output rows: ``npu_s(n)`` / ``host_s(n)`` are the
    modeled seconds of n rows on each side; ``stream_bytes(n_host, n_npu)`` the DRAM bytes
    both sides stream together, floored at ``dram_bytes_s`` (a split needs both). Ties go
    to the NPU (what a server without placement does)."""
    t_npu, t_host = npu_s(N), host_s(N)
    split: tuple[float, int] | None = None
    if allow_split and stream_bytes is not None and dram_bytes_s > 0 and N > SPLIT_ALIGN:
        split = _best_split(N, npu_s, host_s, stream_bytes, dram_bytes_s)
    best = min(t_npu, t_host, split[0] if split else float("inf"))
    if best == t_npu:
        return Choice(NPU, t_npu, t_host, split[0] if split else None, 0)
    if best == t_host:
        return Choice(HOST, t_npu, t_host, split[0] if split else None, N)
    assert split is not None
    return Choice(SPLIT, t_npu, t_host, split[0], split[1])


def _best_split(N: int, npu_s: Callable[[int], float], host_s: Callable[[int], float],
                stream_bytes: Callable[[int, int], float], dram_bytes_s: float) -> tuple[float, int]:
    """(seconds, host rows) of the best aligned split. Its time is the largest of the host
    time (grows with the host's rows), the NPU time (falls) and the DRAM floor (monotone:
    grows when a host weight is wider than its NPU copy, falls otherwise); the optimum is
    where the growing side meets the falling side, found by bisection over the aligned
    boundaries, then the neighbours around it are priced (task padding makes the NPU
    time a step function)."""
    def floor(n_host: int) -> float:
        return stream_bytes(n_host, N - n_host) / dram_bytes_s

    floor_grows = stream_bytes(N, 0) > stream_bytes(0, N)

    def growing(n_host: int) -> float:
        return max(host_s(n_host), floor(n_host)) if floor_grows else host_s(n_host)

    def falling(n_host: int) -> float:
        return npu_s(N - n_host) if floor_grows else max(npu_s(N - n_host), floor(n_host))

    lo, hi = 1, (N - 1) // SPLIT_ALIGN          # boundaries n_host = i * SPLIT_ALIGN, 0 < n_host < N
    if hi < lo:
        return float("inf"), 0
    top = hi
    while lo < hi:
        mid = (lo + hi) // 2
        if growing(mid * SPLIT_ALIGN) < falling(mid * SPLIT_ALIGN):
            lo = mid + 1
        else:
            hi = mid
    return min((max(growing(i * SPLIT_ALIGN), falling(i * SPLIT_ALIGN)), i * SPLIT_ALIGN)
               for i in range(max(1, lo - SPLIT_NEIGHBOURS), min(top, lo + SPLIT_NEIGHBOURS) + 1))


def npu_matmul_seconds(M: int, K: int, N: int, dtype: str, cores: int, submits: int = 1, *,
                       npu_mhz: float = VENDOR_NPU_MHZ) -> float:
    """Modeled NPU seconds of a resident-weight matmul: ``cost.model`` on the documented
    task split (``vendor_style_workload``), ``submits`` submits on our driver path
    (``OWN_DRIVER``), at ``npu_mhz``; 0 rows cost nothing."""
    if N <= 0:
        return 0.0
    work = vendor_style_workload(M, K, N, dtype=dtype, cores=cores)
    return modeled_time(type(work)(work.tasks, submits), npu_mhz=npu_mhz, dram_mhz=cpu.DRAM_MHZ,
                        profile=OWN_DRIVER).total_s


def host_matmul_seconds(weight_type: int | str, M: int, K: int, N: int, threads: int, *,
                        repacked: bool = False, experts: int = 1) -> float:
    """Modeled ggml-cpu seconds of n = ``N`` rows (0 rows cost nothing); ``repacked``: the
    server's host path reads a repacked copy (``rknpu serve``'s default), else the GGUF bytes."""
    if N <= 0:
        return 0.0
    return cpu.cpu_matmul_seconds(weight_type, M, K, N, threads=threads, repacked=repacked, experts=experts)


def place_matmul(weight_type: int | str, M: int, K: int, N: int, *, npu_dtype: str, cores: int, threads: int,
                 allow_split: bool = True, experts: int = 1, repacked: bool = False,
                 npu_mhz: float = VENDOR_NPU_MHZ) -> Choice:
    """The placement of one weight's matmul of ``M`` rows by the two board models (the NPU's
    at ``npu_mhz``). A
    MUL_MAT_ID reading ``experts`` distinct experts: on the NPU each expert is its own
    submit of its share of the rows; on the host one ggml-cpu op streams them all."""
    bpw = cpu.bytes_per_weight(weight_type)
    npu_b = IN_BYTES[npu_dtype]
    rows = ceil_div(M, experts)
    return choose(
        N,
        lambda n: experts * npu_matmul_seconds(rows, K, n, npu_dtype, cores, npu_mhz=npu_mhz),
        lambda n: host_matmul_seconds(weight_type, M, K, n, threads, repacked=repacked, experts=experts),
        lambda nh, nn: K * experts * (nh * bpw + nn * npu_b),
        allow_split=allow_split, dram_bytes_s=dram_bandwidth(cpu.DRAM_MHZ),
    )
