"""Which copies of each weight to keep: host only, NPU only, or both, for the fastest modeled
job within a byte limit. The rule ``rknpu serve --memory-budget`` applies to the weights of
each new plan and ``bench fit`` prices whole models with.

A job is one prompt pass of ``JOB_PROMPT`` tokens and ``JOB_ANSWER`` decode passes; a weight
with both copies runs each pass on its faster side. Starting from the copies the placement
wants, copies are given up one at a time, the least job time lost per byte freed first,
until the bytes fit; host only is the floor (a host copy of 0 bytes: the plain kernel reads
the uploaded bytes). A pure decision: nothing here runs anything. Why: docs/memory.md."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

from ggml_rknpu.cost import placement as pl

JOB_PROMPT, JOB_ANSWER = 512, 128
HOST, NPU, BOTH = "host", "npu", "both"
SIDES = (HOST, NPU, BOTH)
_GIVE_UP = {BOTH: (HOST, NPU), NPU: (HOST,), HOST: ()}    # side -> the sides one copy fewer leaves


@dataclass(frozen=True)
class WeightCost:
    """One weight's copies and modeled seconds per pass on each side: (decode, prompt)."""

    host_bytes: int                  # its repacked host copy (0: the host reads the uploaded bytes)
    npu_bytes: int
    host_s: tuple[float, float]
    npu_s: tuple[float, float]

    def seconds(self, side: str) -> tuple[float, float]:
        if side == HOST:
            return self.host_s
        if side == NPU:
            return self.npu_s
        return min(self.host_s[0], self.npu_s[0]), min(self.host_s[1], self.npu_s[1])

    def job_s(self, side: str) -> float:
        d, p = self.seconds(side)
        return JOB_ANSWER * d + p

    def bytes(self, side: str) -> tuple[int, int]:
        """(host bytes, NPU bytes) of this weight on ``side``."""
        return (self.host_bytes if side != NPU else 0), (self.npu_bytes if side != HOST else 0)


def wanted_side(wheres: Iterable[str]) -> str:
    """The copies a placement wants for a weight it places at ``wheres`` (``cost.placement``'s
    NPU, HOST or SPLIT, one per kind of pass): a copy for each side some pass runs on."""
    places = set(wheres)
    npu, host = bool(places & {pl.NPU, pl.SPLIT}), bool(places & {pl.HOST, pl.SPLIT})
    return BOTH if npu and host else NPU if npu else HOST


def fastest_within(costs: list[WeightCost], wanted: list[str], limit: int | None, npu_limit: int | None,
                   board: Callable[[int, int], int]) -> list[str] | None:
    """Per weight host / NPU / both: from ``wanted``, give up, copy by copy, the one costing the
    least job time per byte freed until the board bytes (``board(host bytes, NPU bytes)``) fit
    ``limit`` and the NPU bytes ``npu_limit`` (None: no bound); None: not even host only fits."""
    sides = list(wanted)
    host, npu = (sum(c.bytes(s)[i] for c, s in zip(costs, sides)) for i in (0, 1))
    while (limit is not None and board(host, npu) > limit) or (npu_limit is not None and npu > npu_limit):
        npu_over = npu_limit is not None and npu > npu_limit
        best: tuple[float, int, str] | None = None
        for i, (c, side) in enumerate(zip(costs, sides)):
            for to in _GIVE_UP[side]:
                (h0, n0), (h1, n1) = c.bytes(side), c.bytes(to)
                freed = (n0 - n1) if npu_over else (h0 + n0 - h1 - n1)
                if freed <= 0:
                    continue
                lost = (c.job_s(to) - c.job_s(side)) / freed
                if best is None or lost <= best[0]:     # a tie: the later weight (first come keeps)
                    best = (lost, i, to)
        if best is None:
            return None
        _, i, to = best
        (h0, n0), (h1, n1) = costs[i].bytes(sides[i]), costs[i].bytes(to)
        host, npu, sides[i] = host - h0 + h1, npu - n0 + n1, to
    return sides
