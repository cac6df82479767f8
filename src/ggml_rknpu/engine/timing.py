"""``Timing``: what one matmul or fusion cost, and where its device seconds come from.

Invariants: host phases are measured on this host; device seconds are "measured" only from
a board's ``hw_elapsed_ns``, else "modeled" by the cost model, else "unknown". Why:
docs/decisions.md "engine/api.py"."""

from __future__ import annotations

from dataclasses import dataclass

from ggml_rknpu.cost.model import ModeledTime
from ggml_rknpu.kernel.job import Completion


@dataclass(frozen=True)
class Timing:
    """One matmul call. Host figures are measured here; ``device_s`` is ``device_label``
    ("measured" from the board's hw_elapsed_ns, "modeled" by the cost model, or "unknown")."""

    pack_s: float
    submit_s: float
    unpack_s: float
    device_s: float | None
    device_label: str
    submits: int

    @property
    def host_s(self) -> float:
        return self.pack_s + self.submit_s + self.unpack_s


def device_seconds(modeled: ModeledTime | None, completion: Completion, hw_ns: int | None) -> tuple[float | None, str]:
    """(seconds, label) of one call on the device: the board's summed hw_elapsed_ns
    ("measured"), else the cost model's figure for its programs ("modeled"), else unknown."""
    if hw_ns is not None and not completion.simulated:
        return hw_ns * 1e-9, "measured"
    if modeled is not None:
        return modeled.total_s, "modeled"
    return None, "unknown"
