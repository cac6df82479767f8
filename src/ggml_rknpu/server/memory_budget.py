"""The memory budget (``rknpu serve --memory-budget``): the board bytes (``board_memory``) the
server may hold, and which copies its weights gave up to stay within them.

A client's buffers are what llama.cpp alone would hold, so they are never refused for the
budget (a model llama.cpp alone loads always loads, toward host-only); the NPU and repacked
host copies beside them are optional. ``server.residency`` decides each weight's copies
within the ``room`` (the board bytes now, the copies promised to weights planned but not yet
staged and those decided but not yet made, ``reserved``, subtracted); any other NPU copy
(MUL_MAT_ID experts, first come) is admitted only if it fits beside them, else its weight runs
in ggml-cpu for good, named in the stats. The default is the machine's ``MemAvailable`` at
start-up less ``RESERVE_RULE``, plus what the server already holds. Why: docs/memory.md."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from ggml_rknpu.server.host_budget import meminfo_bytes

RESERVE_FRACTION = 8          # of MemTotal, kept for the OS, the client process and page cache
MIN_RESERVE = 512 << 20
RESERVE_RULE = "a reserve of MemTotal / 8, at least 512 MiB"
OVER_BUDGET = "NPU copy over the memory budget"


def default_budget(held_now: int, meminfo: Path = Path("/proc/meminfo")) -> int | None:
    """What the machine can spare: MemAvailable less the reserve, plus ``held_now`` (the board
    bytes the server already holds, inside MemTotal but not available); None: unknown."""
    available, total = meminfo_bytes("MemAvailable", meminfo), meminfo_bytes("MemTotal", meminfo)
    if available is None or total is None:
        return None
    return max(0, available - max(MIN_RESERVE, total // RESERVE_FRACTION)) + held_now


@dataclass
class MemoryBudget:
    """``bytes`` of board memory; ``board_now`` reads the accounting's total."""

    bytes: int
    board_now: Callable[[], int]
    promised: int = 0                 # NPU bytes of weights admitted, not yet staged
    reserved: int = 0                 # bytes of copies a residency decided on, not yet made (server.residency)
    board_at_admission: int = 0       # the board bytes the last copies were weighed against (stats)
    gave_up: dict[str, int] = field(default_factory=dict)   # weight -> the NPU bytes it did not get
    npu_only: dict[str, int] = field(default_factory=dict)  # weight -> the repacked host bytes it did not get

    def room(self) -> int:
        """The bytes left beside what is held, promised and reserved (the board bytes read kept)."""
        self.board_at_admission = self.board_now()
        return self.bytes - self.board_at_admission - self.promised - self.reserved

    def admits(self, name: str, npu_bytes: int) -> bool:
        """Whether an NPU copy of ``npu_bytes`` fits beside what is held and promised (then promised)."""
        self.board_at_admission = self.board_now()
        if self.board_at_admission + self.promised + self.reserved + npu_bytes <= self.bytes:
            self.promised += npu_bytes
            return True
        self.gave_up[name] = npu_bytes
        return False

    def settle(self) -> None:
        """The promised weights are staged (or refused): the accounting holds them now."""
        self.promised = 0

    def describe(self) -> str:
        return f"memory budget {self.bytes / 2**20:.0f} MiB of board memory"

    def as_dict(self) -> dict:
        return {"bytes": self.bytes, "board_at_admission": self.board_at_admission, "host_only": dict(self.gave_up),
                "host_only_npu_bytes": sum(self.gave_up.values()), "npu_only": dict(self.npu_only),
                "npu_only_host_bytes": sum(self.npu_only.values())}

    def render(self) -> str:
        if not self.gave_up and not self.npu_only:
            return f"{self.describe()}: nothing given up"
        parts = [f"{len(given)} weights kept {side}, their {copy} ({sum(given.values()) / 2**20:.1f} MiB) given up: "
                 + shown_names(given) for given, side, copy in ((self.gave_up, "host-only", "NPU copies"),
                                                           (self.npu_only, "NPU-only", "repacked host copies"))
                 if given]
        return f"{self.describe()}: " + "; ".join(parts)


def shown_names(given: dict[str, int] | list[str], shown: int = 8) -> str:
    """The first ``shown`` names, sorted, and how many more."""
    names = sorted(given)
    return ", ".join(names[:shown]) + (f" and {len(names) - shown} more" if len(names) > shown else "")


def for_server(state, mib: int | None) -> tuple[MemoryBudget | None, str]:
    """The budget of a server (``rpc.state.ServerState``) for ``--memory-budget MIB`` (None:
    the default), and the words for its start-up line; no budget without an NPU engine."""
    if state.npu is None:
        return None, "no memory budget (no NPU copies to bound)"

    def board_now() -> int:
        return state.board.now(state).total

    if mib is not None:
        budget = MemoryBudget(mib << 20, board_now)
        return budget, f"{budget.describe()} (--memory-budget)"
    chosen = default_budget(board_now())
    if chosen is None:
        return None, "no memory budget (/proc/meminfo does not say what is available)"
    budget = MemoryBudget(chosen, board_now)
    return budget, f"{budget.describe()} (MemAvailable at start-up less {RESERVE_RULE}, plus what the server holds)"
