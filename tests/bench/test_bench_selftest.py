"""rknpu selftest on the simulator: passes through the real engine, and fails loudly when the
corruption hook flips one output element after the NPU returns."""

from __future__ import annotations

import argparse
import dataclasses
import json
import tarfile
from pathlib import Path

import numpy as np
import pytest

from ggml_rknpu.bench import selftest as st
from ggml_rknpu.cli import selftest as cli
from support.bench_support import SMALL_GOLDEN

RIGS = Path(__file__).resolve().parents[1] / "fixtures" / "rigs"
SMALL = ((1, 64, 16), (3, 100, 40))


def run_cli(*argv: str) -> int:
    parser = argparse.ArgumentParser()
    cli.add_arguments(parser)
    return cli.run(parser.parse_args(list(argv)))


@pytest.fixture(autouse=True)
def fast_ladder(monkeypatch):
    """The bring-up ladder with cheap golden shapes and without the long rocket job (both
    run in full in tests/bench/test_bench_ladder.py)."""
    from ggml_rknpu.bench import ladder as ld

    rungs = tuple(dataclasses.replace(r, cases=SMALL_GOLDEN) if r.name == "golden" else r
                  for r in ld.LADDER if r.name != "long_rocket_job")
    monkeypatch.setattr(ld, "LADDER", rungs)


def test_compare_rules_catch_one_wrong_element():
    rng = np.random.default_rng(0)
    a, b = rng.integers(-128, 128, (4, 64), dtype=np.int8), rng.integers(-128, 128, (8, 64), dtype=np.int8)
    c = (a.astype(np.int32) @ b.astype(np.int32).T)
    assert st.compare(c, a, b, "int8")[:3] == (True, 0.0, 0)
    c[1, 2] += 1
    ok, _, n_bad, first = st.compare(c, a, b, "int8")
    assert not ok and n_bad == 1 and first is not None and (first["row"], first["col"]) == (1, 2)
    af, bf = rng.uniform(-1, 1, (4, 256)).astype(np.float32), rng.uniform(-1, 1, (8, 256)).astype(np.float32)
    cf = (af.astype(np.float16).astype(np.float32) @ bf.astype(np.float16).astype(np.float32).T)
    assert st.compare(cf, af, bf, "fp16")[0]
    st.corrupt_one(cf)
    assert st.compare(cf, af, bf, "fp16")[2] == 1


@pytest.mark.timeout(300)
@pytest.mark.parametrize("device", ["sim-rknpu", "sim-rocket"])
def test_selftest_passes_on_the_simulator_and_writes_an_archive(tmp_path, monkeypatch, device):
    monkeypatch.setattr(st, "SIM_SWEEP", SMALL)
    monkeypatch.delenv(st.CORRUPT_ENV, raising=False)
    out = tmp_path / "st"
    assert run_cli("--device", device, "--out", str(out), "--rig-root", str(RIGS / "not_rk3588"),
                   "--iters", "1") == 0
    data = json.loads((out / "selftest.json").read_text())
    assert data["meta"]["result"] == "PASS" and data["raw"]["probe"]["simulated"] is True
    assert data["meta"]["device"] == device
    assert data["raw"]["probe"]["buffer_round_trip"] is True
    behaviour = data["raw"]["probe"]["kernel_behaviour"]   # the harmless rows of kernel/behaviour.py
    assert behaviour["rows"] >= 6 and behaviour["disagreements"] == []
    assert f"kernel behaviour table: {behaviour['rows']} harmless rows, 0 disagreement(s)" in \
        (out / "selftest.md").read_text()
    cases = data["raw"]["cases"]
    assert len(cases) == len(SMALL) * 2 * 2 and all(c["ok"] for c in cases)
    assert {c["dtype"] for c in cases} == {"fp16", "int8"} and {c["cores"] for c in cases} == {1, 3}
    assert all(c["max_abs_err"] == 0 for c in cases if c["dtype"] == "int8")
    md = (out / "selftest.md").read_text()
    assert "simulator (device times modeled)" in md and "| max \\|err\\| | mismatches |" in md
    assert "Bring-up ladder" in md and "three_cores" in md and data["raw"]["envelope"].startswith("proven+ladder")
    assert all(r["status"] == "pass" for r in data["raw"]["ladder"])
    archives = list(out.glob("rknpu-selftest-*.tar.gz"))
    assert len(archives) == 1
    with tarfile.open(archives[0]) as tar:
        assert set(tar.getnames()) == {"selftest.json", "selftest.md", "MANIFEST.json"}
        manifest = tar.extractfile("MANIFEST.json")
        assert manifest is not None
        assert json.load(manifest)["result"] == "PASS"


@pytest.mark.timeout(300)
def test_selftest_fails_loudly_when_one_element_is_corrupted(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(st, "SIM_SWEEP", SMALL)
    monkeypatch.setenv(st.CORRUPT_ENV, "1")
    out = tmp_path / "st"
    assert run_cli("--device", "sim-rknpu", "--out", str(out), "--rig-root", str(RIGS / "not_rk3588"),
                   "--iters", "1") == 1
    printed = capsys.readouterr().out
    assert "selftest FAIL" in printed and "1 mismatching element(s)" in printed
    data = json.loads((out / "selftest.json").read_text())
    assert data["meta"]["result"] == "FAIL" and data["raw"]["corrupted"] is True
    bad = [c for c in data["raw"]["cases"] if not c["ok"]]
    assert len(bad) == 1 and bad[0]["mismatches"] == 1
