"""What a board has proven: the bring-up ladder's passed rungs per board and driver, kept in
a local file, and the envelope the engine may plan in because of them.

Invariants: the envelope widens by the rungs passed from the bottom, in ladder order, and
no further (the ladder stops at its first failure). The file is ``$RKNPU_ENVELOPE_FILE``,
else ``~/.config/ggml-rknpu/envelope.json``:
``{"boards": {"<board key>": {"passed": [rung, ...], "when": "...", "report": "..."}}}``;
``RKNPU_ENVELOPE=proven|extended`` overrides it (extended: the field widths, at the
user's own risk). Why: docs/envelope.md."""

from __future__ import annotations

import json
import os
import time
from fractions import Fraction
from pathlib import Path
from typing import TypedDict

from ggml_rknpu.hw.envelope import EXTENDED, PROVEN, Envelope, by_name
from ggml_rknpu.kernel.device import NpuDevice

FILE_ENV = "RKNPU_ENVELOPE_FILE"
OVERRIDE_ENV = "RKNPU_ENVELOPE"
DEFAULT_FILE = Path("~/.config/ggml-rknpu/envelope.json")


class Widening(TypedDict, total=False):
    """The ``Envelope`` fields a rung widens (``Envelope.widen`` keywords)."""

    max_chain_tasks: dict[str, int]
    max_weight_fill: Fraction
    max_feature_grains: int
    max_cores: int
    max_job_ms: float


# The ladder's rungs, safest first, and the envelope fields each one widens once passed
# (cumulative). A rung that widens nothing proves on this board what the proven envelope
# takes from other boards' streams. The ladder itself (shapes, checks, symptoms) is in
# bench/ladder.py.
RUNG_WIDENINGS: tuple[tuple[str, Widening], ...] = (
    ("golden", {}),
    ("chain_fp16", {}),
    ("chain_int8", {"max_chain_tasks": {"fp16": PROVEN.max_chain_tasks["fp16"], "int8": 16}}),
    ("long_k", {}),
    ("full_weight_bank", {"max_weight_fill": Fraction(1)}),
    ("feature_grains", {"max_feature_grains": EXTENDED.max_feature_grains}),
    ("two_cores", {"max_cores": 2}),
    ("three_cores", {"max_cores": 3}),
    ("long_rocket_job", {"max_job_ms": 450.0}),
)
RUNGS = tuple(name for name, _ in RUNG_WIDENINGS)


def record_path() -> Path:
    return Path(os.environ.get(FILE_ENV) or DEFAULT_FILE).expanduser()


def board_key(device: NpuDevice) -> str:
    """Which board and driver a record is for: the device-tree model (if readable), the
    driver and its version, and "sim" for the simulator."""
    model = "unknown-board"
    try:
        model = device.syscalls.read_text("/proc/device-tree/model").strip("\x00\n ") or model
    except (OSError, AttributeError):
        pass
    info = device.info()
    where = "sim" if device.simulated else "board"
    return f"{where}:{model}:{info.driver_name}-{info.driver_version}"


def load(path: Path | None = None) -> dict:
    path = path or record_path()
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {"boards": {}}
    return data if isinstance(data.get("boards"), dict) else {"boards": {}}


def save_passed(key: str, passed: list[str], report: str = "", path: Path | None = None) -> Path:
    """Record the rungs ``key`` passed (replacing its previous record)."""
    path = path or record_path()
    data = load(path)
    data["boards"][key] = {"passed": list(passed), "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                           "report": report}
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")
    return path


def envelope_for_rungs(passed: list[str] | tuple[str, ...], abi: str | None = None) -> Envelope:
    """PROVEN widened by the rungs passed from the bottom of the ladder, in order. A rung
    that does not apply to ``abi`` (the long rocket job on the vendor driver) is skipped."""
    env, last = PROVEN, None
    for name, widening in RUNG_WIDENINGS:
        if name not in passed:
            if name == "long_rocket_job" and abi != "rocket":
                continue
            break
        if widening:
            env, last = env.widen(**widening), name
    return env if last is None else env.widen(f"proven+ladder:{last}")


def recorded_envelope(device: NpuDevice) -> Envelope:
    """The envelope the engine plans in on ``device`` (module doc)."""
    override = os.environ.get(OVERRIDE_ENV)
    if override:
        return by_name(override)
    entry = load()["boards"].get(board_key(device), {})
    return envelope_for_rungs(entry.get("passed", []), getattr(device, "kind", None))
