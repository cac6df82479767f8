"""Matmul times measured on a board, per weight shape and M bucket, kept beside the
envelope record: what placement by cost decides by once they exist.

Invariants: the file is ``placement.json`` in the envelope record's directory
(``envelope_record.record_path``), ``{"boards": {"<board key>": {"when": ..., "weights":
"fp16"|"int8", "cores": n, "threads": n, "times": [{"type", "K", "N", "experts", "bucket",
"npu_s", "host_s"}, ...]}}}``; times apply only to the weight format, NPU cores and host
threads they were measured with. Why: docs/placement.md "Calibration"."""

from __future__ import annotations

import json
import time
from pathlib import Path

from ggml_rknpu.engine.envelope_record import record_path

TimeKey = tuple[str, int, int, int, str]          # (type name, K, N, experts, bucket)


def placement_path() -> Path:
    return record_path().with_name("placement.json")


def _load(path: Path) -> dict:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {"boards": {}}
    return data if isinstance(data.get("boards"), dict) else {"boards": {}}


def save_times(key: str, weights: str, cores: int, threads: int, times: list[dict],
               path: Path | None = None) -> Path:
    """Record ``times`` (rows as the module doc says) for board ``key``, replacing its previous record."""
    path = path or placement_path()
    data = _load(path)
    data["boards"][key] = {"when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "weights": weights,
                           "cores": cores, "threads": threads, "times": times}
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")
    return path


def load_times(key: str, weights: str, cores: int, threads: int,
               path: Path | None = None) -> dict[TimeKey, tuple[float, float]]:
    """(NPU seconds, host seconds) by shape and bucket for board ``key``, if its record was
    measured with this weight format, core count and thread count; else nothing."""
    entry = _load(path or placement_path())["boards"].get(key)
    if not isinstance(entry, dict) or (entry.get("weights"), entry.get("cores"), entry.get("threads")) != (
            weights, cores, threads):
        return {}
    out: dict[TimeKey, tuple[float, float]] = {}
    for row in entry.get("times", []):
        try:
            k = (str(row["type"]), int(row["K"]), int(row["N"]), int(row["experts"]), str(row["bucket"]))
            out[k] = (float(row["npu_s"]), float(row["host_s"]))
        except (KeyError, TypeError, ValueError):
            continue
    return out
