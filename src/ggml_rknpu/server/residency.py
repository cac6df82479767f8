"""Per weight, the copies one connection keeps: host only, NPU only, or both, decided when a
plan first reads the weight, by ``cost.residency``'s rule within the memory budget's room.

Every later plan follows the decision until the weight's buffer is freed. NPU only: every M
bucket runs the weight on the NPU and no repacked copy is made (its uploaded bytes stay in
the weight pages for GET_TENSOR, re-staging and the host fallback after a fault, which runs
ggml-cpu's plain kernel on them). Host only: no NPU copy. Both: the placement picks per M
bucket. A decided copy not yet made holds its bytes in the budget (``MemoryBudget.reserved``)
until it is made, so a later plan's copies cannot take its room. Why: docs/memory.md "The
memory budget"."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from ggml_rknpu.cost import cpu
from ggml_rknpu.cost import placement as pl
from ggml_rknpu.cost.residency import BOTH, HOST, NPU, WeightCost, fastest_within, wanted_side
from ggml_rknpu.hw.limits import BYTES
from ggml_rknpu.server.memory_budget import MemoryBudget, shown_names
from ggml_rknpu.server.placement_policy import Placer, matmul_kind

log = logging.getLogger("ggml_rknpu.rpc")

# llama.cpp computes logits for a prompt's last row only: the head's prompt pass is one row
HEAD_KINDS = frozenset({"output.weight", "token_embd.weight"})
LABELS = {HOST: "host-only", NPU: "NPU-only", BOTH: "both"}


@dataclass(frozen=True)
class Candidate:
    """A 2-D weight a plan reads that could have an NPU copy; ``key`` as ``WeightStore``'s slots."""

    key: tuple
    name: str
    type: int
    k: int
    n: int
    nbytes: int                 # its uploaded (GGUF) bytes
    repacks: bool               # ggml-cpu keeps a repacked copy of it (the board's model: cost.cpu.kernel)


def repacks(weight_type: int, n: int) -> bool:
    """Whether the board's ggml-cpu repacks a weight of this type and N (False: a type it cannot price)."""
    try:
        return cpu.kernel(weight_type, n, repacked=True).endswith("/repacked")
    except ValueError:
        return False


@dataclass
class Residency:
    """One connection's decisions (weight key -> side) and the bytes its unmade copies hold."""

    placer: Placer | None           # None: every eligible weight on the NPU, no host copies wanted
    budget: MemoryBudget | None     # None: the copies the placement wants, unbounded
    npu_dtype: str = "fp16"
    sides: dict[tuple, str] = field(default_factory=dict)
    _held: dict[tuple[tuple, str], int] = field(default_factory=dict)   # (key, HOST or NPU) -> bytes reserved

    def side(self, key: tuple) -> str | None:
        return self.sides.get(key)

    def decide(self, candidates: list[Candidate]) -> None:
        """Decide the weights not decided yet, the whole set within the budget's room at once."""
        todo = list({c.key: c for c in candidates if c.key not in self.sides}.values())
        if not todo:
            return
        costs, wanted = zip(*(self._cost(c) for c in todo))
        room = self.budget.room() if self.budget is not None else None
        chosen = fastest_within(list(costs), list(wanted), room, None, lambda h, n: h + n) or [HOST] * len(todo)
        for c, cost, want, side in zip(todo, costs, wanted, chosen):
            self.sides[c.key] = side
            if self.placer is not None:
                self.placer.sides[c.name] = side
            if self.budget is None:
                continue
            host_bytes, npu_bytes = cost.bytes(side)
            self._hold(c.key, HOST, host_bytes)
            self._hold(c.key, NPU, npu_bytes)
            if want != HOST and side == HOST:
                self.budget.gave_up[c.name] = cost.npu_bytes
            elif want == BOTH and side == NPU:
                self.budget.npu_only[c.name] = cost.host_bytes
        counts = {s: chosen.count(s) for s in (HOST, NPU, BOTH)}
        gave = {side: [c.name for c, want, got in zip(todo, wanted, chosen) if got == side and want != side]
                for side in (HOST, NPU)}
        log.info("residency of %d new weights: %d host-only, %d NPU-only, %d both%s%s", len(todo), counts[HOST],
                 counts[NPU], counts[BOTH], f" ({self.budget.describe()})" if self.budget is not None else "",
                 "".join(f"; {LABELS[side]} for the budget: {shown_names(names)}" for side, names in gave.items() if names))

    def _cost(self, c: Candidate) -> tuple[WeightCost, str]:
        """The weight's copies, modeled seconds per pass (decode, prompt) and the side its placement wants."""
        head = matmul_kind(c.name) in HEAD_KINDS
        buckets = ("1",) if head else pl.BUCKETS
        policy = self.placer.policy if self.placer is not None else "npu"
        npu_bytes = c.n * c.k * BYTES[self.npu_dtype]
        host_bytes = c.nbytes if c.repacks else 0
        zero = (0.0, 0.0)
        if self.placer is None:
            return WeightCost(host_bytes, npu_bytes, zero, zero), NPU
        try:
            choices = {b: self.placer.choice(c.type, pl.BUCKET_M[b], c.k, c.n)[0] for b in buckets}
        except ValueError:                          # a type the CPU model cannot price: the NPU, as the placer does
            return WeightCost(host_bytes, npu_bytes, zero, zero), HOST if policy == "host" else NPU
        wheres = {"npu": [pl.NPU], "host": [pl.HOST]}.get(policy, [ch.where for ch in choices.values()])
        decode, prompt = choices["1"], choices["1" if head else "prefill"]
        cost = WeightCost(host_bytes, npu_bytes, (decode.host_s, prompt.host_s), (decode.npu_s, prompt.npu_s))
        return cost, wanted_side(wheres)

    def _hold(self, key: tuple, what: str, nbytes: int) -> None:
        if nbytes > 0 and self.budget is not None:
            self._held[(key, what)] = nbytes
            self.budget.reserved += nbytes

    def made(self, key: tuple, what: str) -> int:
        """The ``what`` (HOST or NPU) copy of ``key`` is being made: the bytes it held (0: none)."""
        nbytes = self._held.pop((key, what), 0)
        if nbytes and self.budget is not None:
            self.budget.reserved -= nbytes
        return nbytes

    def drop_buffer(self, handle: int) -> None:
        """The buffer was freed: its weights' decisions and held bytes go."""
        for key in [k for k in self.sides if k[0] == handle]:
            del self.sides[key]
            self.made(key, HOST)
            self.made(key, NPU)

    def close(self) -> None:
        for key in list(self.sides):
            self.made(key, HOST)
            self.made(key, NPU)
        self.sides.clear()
