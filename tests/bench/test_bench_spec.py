"""rknpu bench spec: the modeled pass time by M (priced at the engine's M buckets), the GGUF
shape reader, the early-exit draft writer and the effective-decode arithmetic."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest
from gguf import GGUFReader

from ggml_rknpu.bench import spec
from ggml_rknpu.bench.matmul import modeled_program_time
from ggml_rknpu.cli import bench as cli
from support.gguf_models import TinyConfig, write_tiny_gguf

RIGS = Path(__file__).resolve().parents[1] / "fixtures" / "rigs"
TINY = TinyConfig()            # 2 layers, n_embd 256, 4 heads (2 kv) of 64, n_ff 512


def test_preset_shapes_follow_the_config():
    q = spec.PRESETS["qwen2.5-1.5b"]
    weights = dict(q.weights)
    assert q.n_weights == 28 * 7 + 1
    assert weights[(1536, 256)] == 2 * 28              # k and v: 2 kv heads of 128
    assert weights[(1536, 8960)] == 2 * 28 and weights[(8960, 1536)] == 28
    assert weights[(1536, 151936)] == 1                # the (tied) output head, once per pass


def test_gguf_shapes_are_its_matmul_weights(tmp_path):
    path = write_tiny_gguf(tmp_path / "t.gguf", "llama", "f16")
    shapes = spec.shapes_from_gguf(path)
    weights = dict(shapes.weights)
    assert shapes.n_weights == TINY.n_layer * 7 + 1     # token_embd is a lookup when output.weight exists
    assert weights[(256, 512)] == 2 * TINY.n_layer      # gate, up
    assert weights[(256, 128)] == 2 * TINY.n_layer      # k, v
    assert weights[(256, len(shapes_vocab(path)))] == 1


def shapes_vocab(path: Path) -> list:
    return GGUFReader(path).fields["tokenizer.ggml.tokens"].contents()


def test_pass_time_is_the_sum_of_programs_at_the_engine_bucket():
    shapes = spec.ModelShapes("two", (((1536, 1536), 2), ((1536, 8960), 1)), "test")
    for m, bucket in ((1, 1), (3, 4), (17, 32)):
        want = (2 * modeled_program_time(bucket, 1536, 1536, "int8", 3)
                + modeled_program_time(bucket, 1536, 8960, "int8", 3))
        assert spec.modeled_pass_s(shapes, m, dtype="int8", cores=3) == pytest.approx(want)


def test_regime_rows_show_the_weight_pass_shared_by_the_rows():
    rows = spec.regime_rows(spec.PRESETS["qwen2.5-1.5b"], [1, 16, 32], dtype="int8", cores=3)
    m1, m16, m32 = rows
    assert m1["pass_vs_m1_modeled"] == 1.0 and m1["tok_s_modeled"] == pytest.approx(1e3 / m1["pass_ms_modeled"])
    assert 1.0 < m16["pass_vs_m1_modeled"] < 1.1       # 16 rows for ~the price of one
    assert m16["tok_s_modeled"] > 14 * m1["tok_s_modeled"]
    assert m32["pass_ms_modeled"] > m16["pass_ms_modeled"]


def test_early_exit_draft_keeps_tokenizer_and_renumbers_blocks(tmp_path):
    src = write_tiny_gguf(tmp_path / "t.gguf", "qwen3", "f16", config=TinyConfig(n_layer=3))
    dst = spec.layer_skip_draft(src, tmp_path / "d.gguf", keep=(0, 2))
    a, b = GGUFReader(src), GGUFReader(dst)
    assert b.fields["qwen3.block_count"].contents() == 2
    assert b.fields["tokenizer.ggml.tokens"].contents() == a.fields["tokenizer.ggml.tokens"].contents()
    names = {t.name: t for t in b.tensors}
    assert not any(n.startswith("blk.2.") for n in names)
    src_tensors = {t.name: t for t in a.tensors}
    assert (names["blk.1.attn_q.weight"].data == src_tensors["blk.2.attn_q.weight"].data).all()
    assert (names["output.weight"].data == src_tensors["output.weight"].data).all()


def test_acceptance_row_counts_target_passes():
    mode = spec.SpecMode("ngram-simple", (), 16)
    reply = {"content": "a b c d a b c d", "timings": {"predicted_n": 100, "draft_n": 80, "draft_n_accepted": 60,
                                                        "predicted_per_second": 5.0}}
    row = spec.acceptance_row(mode, "repetitive", reply, "a b c d a b c d")
    assert row["acceptance_measured"] == 0.75
    assert row["tokens_per_pass_measured"] == 100 / 40   # 60 accepted tokens saved 60 of 100 passes
    assert row["same_text_as_plain"] is True
    assert row["distinct_4grams"] == pytest.approx(3 / 5)  # 5 word 4-grams, "a b c d" twice


def test_effective_decode_prices_target_passes_and_draft_passes():
    target = spec.ModelShapes("t", (((1536, 1536), 4),), "test")
    draft = spec.ModelShapes("d", (((1536, 256), 2),), "test")
    t4 = spec.modeled_pass_s(target, 4, dtype="int8", cores=3)
    t1 = spec.modeled_pass_s(target, 1, dtype="int8", cores=3)
    d1 = spec.modeled_pass_s(draft, 1, dtype="int8", cores=3)
    acceptance = [{"mode": "draft-simple", "prompt": "p", "generated": 100, "drafted": 90, "accepted": 60,
                   "tokens_per_pass_measured": 2.5, "rows_per_pass": 4},
                  {"mode": "ngram-simple", "prompt": "p", "generated": 100, "drafted": 0, "accepted": 0,
                   "tokens_per_pass_measured": 1.0, "rows_per_pass": 1}]
    rows = spec.effective_rows(target, draft, acceptance, dtype="int8", cores=3, rkllm=10.0)
    want = 100 / (40 * t4 + (90 + 40) * d1)
    assert rows[0]["tok_s_modeled"] == pytest.approx(want)
    assert rows[0]["vs_rkllm_modeled"] == pytest.approx(want / 10.0)
    assert rows[1]["tok_s_modeled"] == pytest.approx(1 / t1)   # nothing drafted: plain M=1 decode
    assert rows[1]["vs_plain_modeled"] == pytest.approx(1.0)


def test_few_drafts_price_only_that_many_verification_passes():
    target = spec.ModelShapes("t", (((1536, 8960), 4),), "test")
    t16 = spec.modeled_pass_s(target, 16, dtype="int8", cores=3)
    t1 = spec.modeled_pass_s(target, 1, dtype="int8", cores=3)
    row = {"mode": "ngram-simple", "prompt": "p", "generated": 100, "drafted": 30, "accepted": 30,
           "tokens_per_pass_measured": 100 / 70, "rows_per_pass": 16}
    (got,) = spec.effective_rows(target, None, [row], dtype="int8", cores=3, rkllm=None)
    assert got["tok_s_modeled"] == pytest.approx(100 / (30 * t16 + 40 * t1))
    assert got["vs_rkllm_modeled"] is None


def test_draft_ceiling_is_bounded_by_the_draft_passes():
    target, draft = spec.PRESETS["qwen2.5-1.5b"], spec.PRESETS["qwen2.5-0.5b"]
    ceiling = spec.draft_ceiling_tok_s(target, draft, 3, dtype="int8", cores=3)
    t4 = spec.modeled_pass_s(target, 4, dtype="int8", cores=3)
    d1 = spec.modeled_pass_s(draft, 1, dtype="int8", cores=3)
    assert ceiling == pytest.approx(4 / (t4 + 4 * d1))
    assert ceiling < 4 / t4


def test_cli_modeled_only_writes_the_report(tmp_path):
    parser = argparse.ArgumentParser()
    cli.add_arguments(parser)
    out = tmp_path / "out"
    args = parser.parse_args(["spec", "--modeled-only", "--out", str(out), "--rig-root", str(RIGS / "not_rk3588"),
                              "--ms", "1,4,16"])
    assert cli.run(args) == 0
    report = json.loads((out / "spec.json").read_text())
    assert [r["M"] for r in report["raw"]["regime"]] == [1, 4, 16]
    assert "NPU ms/pass (modeled)" in (out / "spec.md").read_text()
