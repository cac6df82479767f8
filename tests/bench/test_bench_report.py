"""Report generation: JSON + Markdown + PNG, and the modeled/measured labelling rule."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from ggml_rknpu.bench import report as rp
from ggml_rknpu.bench.rig import check_rig

RIGS = Path(__file__).resolve().parents[1] / "fixtures" / "rigs"


def sample_report() -> rp.Report:
    rows = [{"dtype": "fp16", "M": m, "gflops_modeled": 2.0 * m} for m in (1, 16, 256)]
    rows += [{"dtype": "int8", "M": m, "gflops_modeled": 5.0 * m} for m in (1, 16, 256)]
    table = rp.Table("matmul", [rp.Column("dtype", "dtype"), rp.Column("M", "M"),
                                rp.Column("gflops_modeled", "GFLOP/s", "{:.1f}", figure=True)], rows)
    plot = rp.Plot("gflops_vs_m.png", "GFLOP/s vs M", "M", "GFLOP/s",
                   rp.series_by(rows, "dtype", "M", "gflops_modeled", "{} ({})"), log_x=True)
    bars = rp.Plot("bars.png", "CPU vs NPU", "test", "t/s",
                   [rp.Series("CPU (measured)", ["pp", "tg"], [10.0, 2.0]),
                    rp.Series("NPU (measured)", ["pp", "tg"], [20.0, 1.5])], kind="bar")
    return rp.Report("matmul", "Matmul benchmark", check_rig(RIGS / "healthy").to_dict(),
                     meta={"device": "sim-rknpu"}, tables=[table], plots=[plot, bars], raw={"rows": rows})


def test_report_writes_json_markdown_and_valid_pngs(tmp_path):
    paths = sample_report().write(tmp_path)
    data = json.loads(paths["json"].read_text())
    assert data["rig"]["verdict"] == "PASS"
    assert [s["label"] for s in data["plots"][0]["series"]] == ["fp16 (modeled)", "int8 (modeled)"]
    assert data["plots"][0]["series"][1]["y"] == [5.0, 80.0, 1280.0]
    md = paths["markdown"].read_text()
    assert "| dtype | M | GFLOP/s (modeled) |" in md and "| int8 | 256 | 1280.0 |" in md
    assert "![GFLOP/s vs M](gflops_vs_m.png)" in md and "rig: **PASS**" in md
    for name in ("gflops_vs_m.png", "bars.png"):
        with Image.open(tmp_path / name) as img:
            img.verify()
        with Image.open(tmp_path / name) as img:
            assert img.format == "PNG" and img.size == (750, 450)


def test_plot_figure_carries_the_series():
    fig = sample_report().plots[0].figure()
    ax = fig.axes[0]
    assert [line.get_label() for line in ax.get_lines()] == ["fp16 (modeled)", "int8 (modeled)"]
    assert np.asarray(ax.get_lines()[0].get_ydata()).tolist() == [2.0, 32.0, 512.0]


def test_unlabelled_figures_are_refused():
    with pytest.raises(ValueError, match="_modeled or _measured"):
        rp.Column("gflops", "GFLOP/s", figure=True)
    with pytest.raises(ValueError, match="modeled' or 'measured"):
        rp.Series("fp16", [1], [2.0])


def test_rig_findings_are_stamped_into_markdown(tmp_path):
    report = sample_report()
    report.rig = check_rig(RIGS / "throttled_dram").to_dict()
    md = report.markdown()
    assert "rig: **FAIL**" in md and "`echo performance > /sys/class/devfreq/dmc/governor`" in md
