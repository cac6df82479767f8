"""llama.cpp's whole test-backend-ops against ``rknpu serve``, op by op, one fresh server per op.

Why one server per op: test-backend-ops aborts at the first closed connection, and a refused
case closes it (that is the validator doing its job), so one op cannot hide the others.
Prints a table (op, cases passed / total, verdict, the server's peak RSS (VmHWM, read just
before it stops: measured), seconds, the op's nodes the NPU ran, the server's first refusal).

    .venv/bin/python tests/e2e/backend_ops_table.py [--ops ADD,MUL_MAT] [--timeout 1800] [--json out.json]
        [--device sim-rocket] [--envelope extended] [--serve-args "--npu-attention auto"]

(``scripts/test-backend-ops-full --table`` runs it.) Verdicts: ``ok`` (every case passed),
``FAIL`` (a case computed a wrong result), ``refused`` (the server closed the connection for
a node no rule admits; the reason is shown), ``aborted`` (the client died otherwise),
``not supported`` (no case ran: ggml-cpu itself does not support the op), ``no cases``
(this build has no case for the op), ``timeout``.
"""

from __future__ import annotations

import argparse
import json
import re
import shlex
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ggml_rknpu.server.placement import NPU  # noqa: E402
from support.e2e_support import rknpu_server, run_backend_ops, run_tool  # noqa: E402
from support.proc_status import status_bytes  # noqa: E402

_REFUSAL = re.compile(r"closing \S+: (.*?)(?: \(the client will abort.*)?$", re.M)


def list_ops() -> list[str]:
    out = run_tool("test-backend-ops", ["--list-ops"], timeout=60).stdout
    return [line.strip() for line in out.splitlines() if re.fullmatch(r"[A-Z0-9_]+", line.strip())]


def peak_rss_mib(pid: int) -> float | None:
    """A live process's peak resident set (VmHWM), or None once it is gone."""
    peak = status_bytes("VmHWM", pid)
    return None if peak is None else peak / 2**20


def run_op(op: str, tmp: Path, timeout: float, device: str = "sim-rknpu", envelope: str = "recorded",
           serve_args: tuple[str, ...] = ()) -> dict:
    t0 = time.perf_counter()
    with rknpu_server(tmp, device=device, extra=("--envelope", envelope, *serve_args), name=f"serve-{op}") as srv:
        assert srv.proc is not None
        try:
            r = run_backend_ops(srv.endpoint, op, timeout=timeout)
        except Exception as exc:             # subprocess.TimeoutExpired
            return {"op": op, "passed": 0, "total": 0, "verdict": "timeout", "reason": str(exc)[:120],
                    "seconds": time.perf_counter() - t0, "peak_rss_mib": peak_rss_mib(srv.proc.pid)}
        peak = peak_rss_mib(srv.proc.pid)
        log = srv.log_path.read_text(errors="replace") if srv.log_path.exists() else ""
    refusals = [m for m in _REFUSAL.findall(log) if "client closed" not in m]
    stats = srv.stats() if srv.stats_path.is_file() else {}
    npu_nodes = sum(row["nodes"] for row in stats.get("per_op", []) if row["op"] == op and row["engine"] == NPU)
    if r.total and r.passed == r.total and r.backend_ok:
        verdict = "ok"
    elif r.total:
        verdict = "FAIL"
    elif refusals:
        verdict = "refused"
    elif r.returncode == 0:
        verdict = "not supported" if "not supported" in r.output else "no cases"
    else:
        verdict = "aborted"
    return {"op": op, "passed": r.passed, "total": r.total, "verdict": verdict,
            "reason": refusals[0][:160] if refusals else "", "seconds": time.perf_counter() - t0,
            "peak_rss_mib": peak, "npu_nodes": npu_nodes}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ops", help="comma-separated ops (default: every op of --list-ops)")
    ap.add_argument("--timeout", type=float, default=1800.0, help="seconds per op")
    ap.add_argument("--json", type=Path, help="write the rows as JSON")
    ap.add_argument("--device", default="sim-rknpu", choices=("sim-rknpu", "sim-rocket"),
                    help="the simulated driver the servers run on")
    ap.add_argument("--envelope", default="recorded", choices=("recorded", "proven", "extended"),
                    help="rknpu serve --envelope (extended: three cores; on sim-rocket a file per core)")
    ap.add_argument("--serve-args", default="", help="more `rknpu serve` arguments, one shell-quoted string")
    args = ap.parse_args(argv)
    ops = args.ops.split(",") if args.ops else list_ops()
    rows = []
    with tempfile.TemporaryDirectory(prefix="backend-ops-") as tmp:
        for op in ops:
            row = run_op(op, Path(tmp), args.timeout, args.device, args.envelope, tuple(shlex.split(args.serve_args)))
            rows.append(row)
            peak = row["peak_rss_mib"]
            print(f"{row['op']:<24} {row['passed']:>6}/{row['total']:<6} {row['verdict']:<14} "
                  f"{'-' if peak is None else f'{peak:.0f}':>6} MiB {row['seconds']:7.1f}s "
                  f"{row.get('npu_nodes', 0):>6} on the NPU  {row['reason']}", flush=True)
    ok = [r for r in rows if r["verdict"] == "ok"]
    peaks = [r["peak_rss_mib"] for r in rows if r["peak_rss_mib"] is not None]
    print(f"\n{len(ok)}/{len(rows)} ops pass every case ({sum(r['passed'] for r in ok)} cases); "
          f"{sum(r['passed'] for r in rows)}/{sum(r['total'] for r in rows)} cases passed over all ops; "
          f"server peak RSS {max(peaks, default=0):.0f} MiB (measured)")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))
    return 0 if len(ok) == len(rows) else 1


if __name__ == "__main__":
    sys.exit(main())
