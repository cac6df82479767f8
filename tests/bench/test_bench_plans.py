"""Plan rows of ``rknpu bench decode`` (bench/plans.py): the cpu plan is the CPU model on
llama.cpp's quantizer mix, auto is never slower than all-NPU (it picks per weight), a
split never loses to auto, host ops cost the same in every plan, and the report carries
JSON rows with a ``plan`` field, Markdown and a PNG. All figures *modeled*."""

from __future__ import annotations

import json

import pytest

from ggml_rknpu.bench import plans
from ggml_rknpu.bench.shapes import PRESETS
from ggml_rknpu.cost import cpu
from ggml_rknpu.cost import host_ops as ho
from ggml_rknpu.cost import placement as pl
from ggml_rknpu.cost.cpu_anchors import CPU_ANCHOR_TOLERANCE


def test_quantizer_mix_follows_llama_cpp():
    gemma = {(w.name, w.type): w.count for w in plans.preset_weights(PRESETS["Gemma3-1B"], "Q6_K")}
    # K = 1152 rows do not divide into Q6_K's 256-blocks: Q8_0; O (K = 1024) and down (K = 6912) stay Q6_K
    assert gemma[("q", "Q8_0")] == 26 and gemma[("o", "Q6_K")] == 26 and gemma[("down", "Q6_K")] == 26
    assert gemma[("output", "Q8_0")] == 1
    qwen = {(w.name, w.type): w.count for w in plans.preset_weights(PRESETS["Qwen2.5-1.5B"], "Q4_K_M")}
    more = sum(plans._more_bits(i, 28) for i in range(28))
    assert qwen[("down", "Q6_K")] == qwen[("v", "Q6_K")] == more and qwen[("down", "Q4_K")] == 28 - more
    assert qwen[("q", "Q4_K")] == 28 and qwen[("output", "Q6_K")] == 1
    with pytest.raises(ValueError):
        plans.preset_weights(PRESETS["Qwen3-0.6B"], "Q3_K")


@pytest.mark.parametrize("name", ["Gemma3-1B", "Qwen3-0.6B"])
def test_auto_is_the_per_weight_minimum(name):
    model = PRESETS[name]
    weights = plans.preset_weights(model, plans.DEFAULT_QUANT[name])
    for m in (1, 16, 512):
        for cores in (1, 3):
            t = {p: plans.pass_seconds(weights, model.host_layers(), p, m, npu_dtype="int8", cores=cores)
                 for p in plans.PLANS}
            assert t["auto"] <= t["npu"] and t["auto-split"] <= t["auto"] * (1 + 1e-12)
            placed = plans.place(weights, "auto", m, npu_dtype="int8", cores=cores)
            for p in placed:
                c = pl.place_matmul(p.weight.type, m, p.weight.K, p.weight.N, threads=4, allow_split=False,
                                    repacked=True, npu_dtype="int8", cores=cores)   # the server's repacked host copies
                assert p.seconds == min(c.npu_s, c.host_s) and p.where == c.where
            host_ops = ho.host_ops_seconds(model.host_layers(), m, 0)
            assert t["cpu"] == pytest.approx(host_ops + sum(
                cpu.cpu_matmul_seconds(w.type, m, w.K, w.N) * w.count for w in weights))


def test_job_is_a_prompt_then_the_answer():
    model = PRESETS["Llama-3.2-1B"]
    w = plans.preset_weights(model, "Q4_K_M")
    kw = dict(npu_dtype="int8", cores=3)
    host = model.host_layers()
    job = plans.job_seconds(w, host, "auto", **kw)
    assert job == pytest.approx(plans.JOB_PROMPT / plans.prefill_tok_s(w, host, "auto", plans.JOB_PROMPT, **kw)
                                + plans.JOB_ANSWER / plans.decode_tok_s(w, host, "auto", 1, past=plans.DECODE_PAST,
                                                                        **kw))


def test_gguf_types_are_read_from_the_file(tmp_path):
    from support.gguf_models import TinyConfig, write_tiny_gguf

    path = write_tiny_gguf(tmp_path / "tiny.gguf", "llama")
    weights = plans.gguf_weights(path)
    c = TinyConfig()
    names = {w.name for w in weights}
    assert names == {"q", "k", "v", "o", "gate", "up", "down", "output"}
    assert sum(w.count for w in weights if w.name == "q") == c.n_layer
    assert all(cpu.bytes_per_weight(w.type) > 0 for w in weights)


def test_bench_decode_reports_the_plans(tmp_path):
    from ggml_rknpu.cli.main import main

    out = tmp_path / "report"
    rc = main(["bench", "decode", "gemma3-1b", "--weights", "int8", "--ms", "1", "--host-reps", "0",
               "--allow-throttled", "--out", str(out)])
    assert rc == 0
    rows = json.loads((out / "decode.json").read_text())["raw"]["plans"]
    assert {(r["plan"], r["envelope"]) for r in rows} == {(p, e) for p in plans.PLANS
                                                          for e in ("laddered, 3 core(s)", "proven, 1 core(s)")}
    cpu_row = next(r for r in rows if r["plan"] == "cpu")
    assert cpu_row["published"] == "pp512 164.7 / tg128 28.3" and cpu_row["quant"] == "Q4_0"
    assert abs(cpu_row["decode_m1_tok_s_modeled"] / 28.3 - 1) <= CPU_ANCHOR_TOLERANCE
    assert all(r["decode_m1_vs_cpu_modeled"] > 0 for r in rows)
    md = (out / "decode.md").read_text()
    assert "Plans: llama.cpp's CPU alone" in md and "auto-split" in md
    assert (out / "plans_job_s.png").stat().st_size > 0
