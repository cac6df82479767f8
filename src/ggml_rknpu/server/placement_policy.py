"""The server's placement policy for weight matmuls (``rknpu serve --placement``): auto
(each weight and M bucket where the board's models say it is faster), npu (every weight
on the NPU), host (every weight matmul in ggml-cpu, from a repacked copy where ggml repacks
the type, else its GGUF bytes), and what it chose.

Invariants: decisions are the board's models (``cost.placement``: NPU at its envelope's
cores, ggml-cpu on the A76 cluster at ``threads``) on every machine, so the simulator
plans what a board would, except that on a board times measured there
(``engine.placement_record``) replace the models for the shapes they cover; a weight the
policy keeps on the host is never staged (it takes no NPU memory); auto chooses between the
two sides only, unless ``split`` (opt-in) lets a MUL_MAT run its rows on both at once.
Decisions are cached per (type, K, N, experts, bucket). Why: docs/placement.md."""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass, field
from typing import Any

from ggml_rknpu.cost import cpu
from ggml_rknpu.cost import placement as pl
from ggml_rknpu.cost.model import VENDOR_CLOCK, NpuClock

log = logging.getLogger("ggml_rknpu.rpc")

POLICIES = ("auto", "npu", "host")
HOST_REASON = "placed on the host by cost"
_LAYER = re.compile(r"^blk\.\d+\.")


def matmul_kind(name: str) -> str:
    """A weight's kind: its tensor name without the layer (``blk.3.attn_q.weight`` -> ``attn_q.weight``)."""
    return _LAYER.sub("", name) or "?"


@dataclass
class KindRecord:
    """Planned matmuls of one kind, M and weight type: where they go and the two times
    they were decided by (at the bucket's M; ``basis`` "modeled" or "measured")."""

    where: str
    npu_s: float
    host_s: float
    basis: str
    planned: int = 0
    weight_bytes: int = 0


@dataclass
class Placer:
    policy: str = "auto"
    npu_dtype: str = "fp16"
    cores: int = 1
    threads: int = cpu.BIG_CORES
    measured: dict[tuple[str, int, int, int, str], tuple[float, float]] = field(default_factory=dict)
    host_repack: bool = False      # host matmuls read repacked copies (priced at ggml-cpu's repacked kernel)
    split: bool = False            # auto may split a MUL_MAT's rows between the NPU and the host
    npu_clock: NpuClock = VENDOR_CLOCK   # the NPU side is modeled at this clock
    records: dict[tuple[str, int, str], KindRecord] = field(default_factory=dict)   # (kind, M, type)
    sides: dict[str, str] = field(default_factory=dict)   # weight -> its copies (server.residency): host, npu, both
    _cache: dict[tuple, tuple[pl.Choice, str]] = field(default_factory=dict)
    _logged: set[str] = field(default_factory=set)

    def __post_init__(self) -> None:
        if self.policy not in POLICIES:
            raise ValueError(f"placement must be one of {POLICIES}, not {self.policy!r}")
        if not 1 <= self.threads <= cpu.BIG_CORES:
            raise ValueError(f"host threads must be 1..{cpu.BIG_CORES} (the board's A76 cores), got {self.threads}")

    def describe(self) -> str:
        measured = f", {len(self.measured)} shape/bucket times measured on this board" if self.measured else ""
        return (f"placement {self.policy} (board models: NPU {self.npu_dtype} on {self.cores} core(s) at "
                f"{self.npu_clock}, "
                f"ggml-cpu on {self.threads} A76 thread(s){measured}; host matmuls run from "
                f"{'repacked copies where ggml repacks' if self.host_repack else 'the GGUF bytes'})")

    def choice(self, weight_type: int | str, M: int, K: int, N: int, experts: int = 1) -> tuple[pl.Choice, str]:
        """(the choice, "measured" or "modeled"): measured times of this shape and bucket
        when the board has them, else the models."""
        b = pl.bucket(M)
        key = (cpu.type_name(weight_type), K, N, experts, b)
        cached = self._cache.get(key)
        if cached is None:
            times = self.measured.get(key)
            if times is not None:
                npu_s, host_s = times
                cached = pl.choose(N, lambda n: npu_s, lambda n: host_s, allow_split=False), "measured"
            else:
                cached = pl.place_matmul(weight_type, pl.BUCKET_M[b], K, N, npu_dtype=self.npu_dtype,
                                         cores=self.cores, threads=self.threads,
                                         allow_split=self.split and self.policy == "auto" and experts == 1,
                                         experts=experts, repacked=self.host_repack and experts == 1,
                                         npu_mhz=self.npu_clock.mhz), "modeled"
            self._cache[key] = cached
        return cached

    def on_npu(self, name: str, weight_type: int, M: int, K: int, N: int, nbytes: int, experts: int = 1,
               npu_only: bool = False) -> bool:
        """Whether this weight's matmul of ``M`` rows goes to the NPU (recorded for the stats);
        ``npu_only``: the weight has no host copy (``server.residency``), so it does."""
        try:
            c, basis = self.choice(weight_type, M, K, N, experts)
        except ValueError:            # a type the CPU model cannot price: the NPU path, as without placement
            return npu_only or self.policy != "host"
        where = pl.NPU if npu_only else {"npu": pl.NPU, "host": pl.HOST}.get(self.policy, c.where)
        key = (matmul_kind(name), M, cpu.type_name(weight_type))
        rec = self.records.setdefault(key, KindRecord(where, c.npu_s, c.host_s, basis))
        rec.planned += 1
        rec.weight_bytes += nbytes
        return where in (pl.NPU, pl.SPLIT)

    def host_rows(self, weight_type: int, M: int, K: int, N: int) -> int:
        """The rows of this weight's MUL_MAT the host runs beside the NPU (0: not split)."""
        try:
            c, _ = self.choice(weight_type, M, K, N)
        except ValueError:
            return 0
        return c.host_rows if c.where == pl.SPLIT else 0

    def log_new_buckets(self) -> None:
        """Say once per M bucket what the plans keep where (the first plan of each bucket)."""
        by_bucket: dict[str, dict[str, list[int]]] = {}
        for (_, m, _), rec in self.records.items():
            side = by_bucket.setdefault(pl.bucket(m), {}).setdefault(rec.where, [0, 0])
            side[0] += rec.planned
            side[1] += rec.weight_bytes
        for b, sides in by_bucket.items():
            if b in self._logged:
                continue
            self._logged.add(b)
            log.info("placement %s, M bucket %s: %s", self.policy, b, ", ".join(
                f"{n} weight matmuls on the {where} ({nbytes / 2**20:.1f} MiB GGUF bytes)"
                for where, (n, nbytes) in sorted(sides.items())))

    def as_dict(self) -> dict:
        return {"policy": self.policy, "npu_dtype": self.npu_dtype, "cores": self.cores,
                "npu_clock": str(self.npu_clock), "threads": self.threads, "host_repack": self.host_repack, "split": self.split,
                "measured_shapes": len(self.measured),
                "by_kind": [{"kind": k, "M": m, "type": t, "bucket": pl.bucket(m), "where": r.where,
                             "npu_s": r.npu_s, "host_s": r.host_s, "basis": r.basis, "planned": r.planned}
                            for (k, m, t), r in sorted(self.records.items())],
                "residency": self.residency()}

    def residency(self) -> dict[str, int]:
        """How many weights keep which copies (host only, NPU only, both)."""
        return {side: sum(1 for s in self.sides.values() if s == side) for side in ("host", "npu", "both")}

    def render(self) -> str:
        if not self.records:
            return ""
        counts = self.residency()
        lines = [f"weight copies: {counts['host']} host-only, {counts['npu']} NPU-only, {counts['both']} both",
                 f"{self.describe()}; per matmul kind and M (the times decided by, at the bucket's M):"]
        for (k, m, t), r in sorted(self.records.items()):
            lines.append(f"  {k} ({t}) M={m}: {r.where} (NPU {r.npu_s * 1e6:.0f} µs, host {r.host_s * 1e6:.0f} µs, "
                         f"{r.basis}), {r.planned} planned")
        return "\n".join(lines)


def placer_for(npu: Any, policy: str, weight_format: str, threads: int | None, host_repack: bool = False,
               split: bool = False) -> Placer:
    """The policy for an engine: the NPU side at the cores its envelope allows (1 when the
    engine does not say) and at the engine's NPU clock (``VENDOR_CLOCK`` when it knows none),
    the host side at ``threads`` A76 threads (None: all four; more
    than the board has: all four); on a board, the times measured there for this format,
    cores and threads (none off a board: the simulator's times are not the board's)."""
    cores = getattr(npu, "cores", None)
    cores = cores if isinstance(cores, int) and cores >= 1 else 1
    threads = min(threads or cpu.BIG_CORES, cpu.BIG_CORES)
    measured = {}
    device = getattr(npu, "device", None)
    if device is not None and getattr(device, "simulated", True) is False:
        from ggml_rknpu.engine.envelope_record import board_key
        from ggml_rknpu.engine.placement_record import load_times

        measured = load_times(board_key(device), weight_format, cores, threads)
    clock = getattr(npu, "npu_clock", None)
    return Placer(policy, weight_format, cores, threads, measured, host_repack, split,
                  npu_clock=clock if isinstance(clock, NpuClock) else VENDOR_CLOCK)
