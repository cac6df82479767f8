"""rknpu bench prefill: TTFT by prompt length per plan, every host op priced, attention on
the NPU as its own plan (the server's --npu-attention auto), published figures beside (never fitted), Markdown, JSON and
a PNG; shapes from a Hugging Face config.json. All figures *modeled*."""

from __future__ import annotations

import json

import pytest

from ggml_rknpu.bench import plans
from ggml_rknpu.bench import prefill as pf
from ggml_rknpu.bench.shapes import PRESETS
from ggml_rknpu.cost import host_ops as ho

QWEN = PRESETS["Qwen3-1.7B"]
WEIGHTS = plans.preset_weights(QWEN, "Q4_K_M")


def test_a_long_prompt_is_ubatches_after_each_other():
    """4096 tokens = 8 passes of 512 rows over a growing cache: the cpu plan's TTFT is the
    matmuls 8 times plus the host ops of each pass at its fill level."""
    host = QWEN.host_layers()
    kw: dict = dict(npu_dtype="int8", cores=3)
    t = plans.prompt_seconds(WEIGHTS, host, "cpu", 4096, **kw)
    passes = sum(plans.pass_seconds(WEIGHTS, host, "cpu", 512, past=s, head_rows=1 if s == 3584 else 0, **kw)
                 for s in range(0, 4096, 512))
    assert t == pytest.approx(passes)
    attention = [sum(ho.attention_time(layer, 512, s).total_s for layer in host) for s in (0, 3584)]
    assert attention[1] > 10 * attention[0]          # the last pass sees 8x the keys
    assert plans.prefill_tok_s(WEIGHTS, host, "cpu", 4096, **kw) < plans.prefill_tok_s(WEIGHTS, host, "cpu", 512, **kw)


def test_rows_per_plan_and_the_attention_plan_takes_the_faster_side():
    rows = pf.prompt_rows(QWEN, "Q4_K_M", WEIGHTS, "laddered", 3, "int8", (512, 4096))
    by = {(r["plan"], r["prompt"]): r for r in rows}
    assert {r["plan"] for r in rows} == set(pf.PLAN_NAMES)
    for n in (512, 4096):
        cpu = by[("cpu", n)]
        assert cpu["ttft_vs_cpu_modeled"] == 1
        assert by[(pf.ATTN_NPU, n)]["ttft_s_modeled"] <= by[("auto", n)]["ttft_s_modeled"]
        assert by[("auto", n)]["ttft_s_modeled"] <= by[("npu", n)]["ttft_s_modeled"] * (1 + 1e-12)
        assert cpu["prefill_tok_s_modeled"] == pytest.approx(n / cpu["ttft_s_modeled"])
    # attention's share grows with the prompt on the host side
    assert by[("auto", 4096)]["attention_share_modeled"] > by[("auto", 512)]["attention_share_modeled"]
    host_s, best_s = pf.attention_split(QWEN.host_layers(), 4096, 3)
    assert best_s < host_s


def test_goal_rows_compare_against_a_fifth_of_the_cpu_plan():
    rows = pf.prompt_rows(QWEN, "Q4_K_M", WEIGHTS, "laddered", 3, "int8", (512, 4096))
    goals = pf.goal_rows(rows)
    assert [(g["prompt"], g["plan"]) for g in goals] == [(512, "auto"), (4096, "auto"), (4096, pf.ATTN_NPU)]
    for g in goals:
        assert g["goal_ttft_s_modeled"] == pytest.approx(g["cpu_ttft_s_modeled"] / pf.GOAL)
        assert g["goal"] == ("met" if g["ttft_s_modeled"] <= g["goal_ttft_s_modeled"] else "not met")


def test_bench_prefill_report_from_a_config(tmp_path):
    from ggml_rknpu.cli.main import main

    cfg = tmp_path / "tiny" / "config.json"
    cfg.parent.mkdir()
    cfg.write_text(json.dumps({"hidden_size": 512, "intermediate_size": 1536, "num_hidden_layers": 4,
                               "num_attention_heads": 8, "num_key_value_heads": 2, "head_dim": 64,
                               "vocab_size": 32000}))
    out = tmp_path / "report"
    rc = main(["bench", "prefill", str(cfg.parent), "qwen3-0.6b", "--prompts", "128,1024,2048", "--allow-throttled",
               "--out", str(out)])
    assert rc == 0
    data = json.loads((out / "prefill.json").read_text())
    rows = data["raw"]["rows"]
    assert {r["model"] for r in rows} == {"tiny", "Qwen3-0.6B"}
    assert {r["prompt"] for r in rows} == {128, 1024, 2048}
    assert len(rows) == 2 * 2 * 3 * len(pf.PLAN_NAMES)          # models x envelopes x prompts x plans
    published = {r["prompt"]: r["published"] for r in rows if r["model"] == "Qwen3-0.6B" and r["plan"] == "npu"}
    assert published[128].startswith("199 ms") and published[1024].startswith("4247 ms")
    md = (out / "prefill.md").read_text()
    assert "(modeled)" in md and "--npu-attention auto" in md and "Goals" in md
    assert (out / "prefill_ttft_s.png").stat().st_size > 0
    assert main(["bench", "prefill", "qwen3-0.6b", "--prompts", "0", "--allow-throttled", "--out", str(out)]) == 1


def test_prefill_is_at_the_npu_clock_check_rig_reads(tmp_path):
    from pathlib import Path

    from ggml_rknpu.cli.main import main

    rigs = Path(__file__).resolve().parents[1] / "fixtures" / "rigs"
    ttft = {}
    for name in ("not_rk3588", "mainline_rocket"):
        out = tmp_path / name
        assert main(["bench", "prefill", "qwen3-0.6b", "--prompts", "512", "--allow-throttled",
                     "--rig-root", str(rigs / name), "--out", str(out)]) == 0
        data = json.loads((out / "prefill.json").read_text())
        ttft[name] = next(r["ttft_s_modeled"] for r in data["raw"]["rows"] if r["plan"] == "npu")
        assert data["meta"]["npu_clock"] in (out / "prefill.md").read_text()
    assert data["meta"]["npu_clock"] == "200 MHz (check-rig: this board's NPU clock now)"
    assert ttft["mainline_rocket"] > 1.5 * ttft["not_rk3588"]     # the NPU matmuls at a fifth of the clock
