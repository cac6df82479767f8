"""The server's counters as ``--stats`` text and ``--stats-json``: everything ``ServerState``
holds (op counters, recovery, sessions, turns, shared weights, placement, injected faults, NPU
memory), read under a turn since the sessions' computes update them."""

from __future__ import annotations

import json
import logging
from dataclasses import asdict
from typing import Any

from ggml_rknpu.server.rpc.state import ServerState

log = logging.getLogger("ggml_rknpu.rpc")


def stats_dict(state: ServerState) -> dict:
    """Every counter, machine-readable (``--stats-json``)."""
    with state.turns:
        out = state.stats.as_dict(state.weight_stats, getattr(state.npu, "counters", None))
        out["recovery"] = state.recovery.as_dict()
        out["sessions"] = asdict(state.sessions)
        out["turns"] = state.turns.as_dict()
        out["shared_weights"] = state.live.as_dict()
        out["board_memory"] = state.board.now(state).as_dict()
        out["memory_budget"] = state.budget.as_dict() if state.budget is not None else None
        if state.activations is not None:
            out["activations"] = state.activations.as_dict()
        if state.placer is not None:
            out["placement"] = state.placer.as_dict()
        if state.faults is not None:
            out["faults_injected"] = dict(state.faults.counts, submits=state.faults.submits)
        npu: Any = state.npu             # memory_used / memory_cap: the engines that cap NPU memory
        if hasattr(npu, "memory_used"):
            out["npu_memory"] = {"used_bytes": npu.memory_used(), "cap_bytes": npu.memory_cap,
                                 "peak_bytes": getattr(npu, "peak_memory", None)}
        return out


def render_stats(state: ServerState) -> str:
    """Every counter as the ``--stats`` text (SIGUSR1, after each client, at exit)."""
    with state.turns:
        lines = [state.stats.render(state.weight_stats), state.recovery.render()]
        c = state.sessions
        turns = state.turns
        lines.append(f"connections: {c.now} now, {c.peak} at most at once, {c.refused_at_accept} refused at accept, "
                     f"{c.stalled} stalled, {c.too_slow} too slow, {c.idle_closed} idle; {state.live.copies} staged "
                     f"copies shared ({state.live.shared} stagings from another session's); {turns.waited} of "
                     f"{turns.granted} turns waited {turns.wait_seconds:.2f} s")
        if state.placer is not None and state.placer.records:
            lines.append(state.placer.render())
        if state.faults is not None:
            lines.append(f"faults injected (--sim-faults): {state.faults.counts} in {state.faults.submits} submits")
        w = state.weight_stats
        lines.append(f"weights resident on the NPU: {w.staged} ({w.staged_bytes / 2**20:.1f} MiB ggml data); on the "
                     f"host: {w.host_now} ({w.host_bytes_now / 2**20:.1f} MiB)")
        lines.append(state.board.now(state).render() + (f"; {state.budget.render()}" if state.budget else ""))
        npu: Any = state.npu
        if hasattr(npu, "memory_used"):
            cap = npu.memory_cap
            lines.append(f"NPU memory used: {npu.memory_used() / 2**20:.1f} MiB"
                         + (f" of a {cap / 2**20:.0f} MiB cap" if cap is not None else ""))
        return "\n".join(lines) + "\n"


def write_stats_json(state: ServerState) -> None:
    """Rewrite ``--stats-json`` (if set) whole, atomically; sessions end (and write) concurrently."""
    path = state.config.stats_json
    if path is None:
        return
    try:
        with state.stats_file:
            tmp = path.with_name(path.name + ".tmp")
            tmp.write_text(json.dumps(stats_dict(state), indent=1))
            tmp.replace(path)
    except OSError as exc:
        log.warning("cannot write --stats-json %s: %s", path, exc)
