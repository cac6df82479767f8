"""rknpu bench spec, heads: the head shapes follow llama.cpp's tensors, a step is the target's
verification plus the head's passes, the chain model inverts, and the goals' acceptance length
is what the step costs say."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from ggml_rknpu.bench import spec_heads as sh
from ggml_rknpu.bench.spec_shapes import PRESET_DIMS, PRESETS, modeled_step_s
from ggml_rknpu.cli import bench as cli

RIGS = Path(__file__).resolve().parents[1] / "fixtures" / "rigs"
TARGET = PRESETS["qwen2.5-1.5b"]
HEADS = sh.heads_for(PRESET_DIMS["qwen2.5-1.5b"], "qwen2.5-1.5b")


def test_eagle3_head_is_fc_one_layer_on_two_inputs_and_the_draft_vocab():
    weights = dict(HEADS["eagle3"].weights)
    assert weights[(3 * 1536, 1536)] == 1                 # fc over 3 target layers
    assert weights[(2 * 1536, 12 * 128)] == 1             # q reads [embedding; features]
    assert weights[(2 * 1536, 2 * 128)] == 2              # k, v
    assert weights[(1536, 8960)] == 2 and weights[(8960, 1536)] == 1
    assert weights[(1536, sh.EAGLE3_DRAFT_VOCAB)] == 1
    assert HEADS["eagle3"].n_weights == 9


def test_mtp_head_is_eh_proj_one_target_layer_and_the_full_head():
    weights = dict(HEADS["mtp"].weights)
    assert weights[(2 * 1536, 1536)] == 1
    assert weights[(1536, 151936)] == 1                   # the shared full-vocabulary head
    assert HEADS["mtp"].n_weights == 1 + 7 + 1


def test_step_is_verification_plus_the_head_passes():
    head = HEADS["eagle3"]
    for n in (1, 3, 7):
        want = (modeled_step_s(TARGET, n + 1, dtype="int8", cores=3)
                + n * modeled_step_s(head, 1, dtype="int8", cores=3)
                + modeled_step_s(head, n + 1, dtype="int8", cores=3))
        assert sh.step_s(TARGET, head, n, dtype="int8", cores=3) == pytest.approx(want)
    # the head is far cheaper than the target: one layer and a 32k head against 28 layers and a 152k head
    assert modeled_step_s(head, 1, dtype="int8", cores=3) < 0.1 * modeled_step_s(TARGET, 1, dtype="int8", cores=3)


def test_chain_model_and_its_inverse():
    assert sh.chain_tau(0.0, 5) == 1.0 and sh.chain_tau(1.0, 5) == 6.0
    assert sh.chain_tau(0.5, 2) == pytest.approx(1 + 0.5 + 0.25)
    alpha = sh.alpha_from_tau(2.17)
    assert sh.chain_tau(alpha, 1000) == pytest.approx(2.17)
    assert all(sh.chain_tau(alpha, n) < 2.17 for n in sh.DRAFT_NS)     # the lower bound: short chains accept less
    assert sh.chain_tau(sh._alpha_for(3.0, 4), 4) == pytest.approx(3.0)


def test_published_rows_carry_their_source_and_pick_the_best_length():
    rows = sh.published_rows(TARGET, HEADS, dtype="int8", cores=3, rkllm=16.7)
    assert [r["tau_published_measured"] for r in rows] == [p.tau for p in sh.PUBLISHED]
    assert all(r["source"] for r in rows)
    for row, pub in zip(rows, sh.PUBLISHED):
        head = HEADS[pub.head]
        alpha = sh.alpha_from_tau(pub.tau)
        by_n = {n: sh.chain_tau(alpha, n) / sh.step_s(TARGET, head, n, dtype="int8", cores=3) for n in sh.DRAFT_NS}
        assert row["best_n_draft"] == max(by_n, key=lambda n: by_n[n])
        assert row["tok_s_modeled"] == pytest.approx(by_n[row["best_n_draft"]])
        assert row["vs_rkllm_modeled"] == pytest.approx(row["tok_s_modeled"] / 16.7)


def test_needed_tau_meets_the_goal_exactly_and_fits_the_draft():
    rows = sh.needed_rows(TARGET, HEADS, dtype="int8", cores=3, rkllm=16.7)
    assert {(r["head"], r["goal"]) for r in rows} == {(h, g) for h in HEADS for g in ("2.5x RKLLM", "1.5x CPU Q4_0")}
    for r in rows:
        cost = sh.step_s(TARGET, HEADS[r["head"]], r["n_draft"], dtype="int8", cores=3)
        assert r["tau_needed_modeled"] / cost == pytest.approx(r["goal_tok_s"])
        assert r["tau_needed_modeled"] <= r["n_draft"] + 1
        for n in sh.DRAFT_NS:   # no other draft length needs less
            tau = r["goal_tok_s"] * sh.step_s(TARGET, HEADS[r["head"]], n, dtype="int8", cores=3)
            assert tau > n + 1 or tau >= r["tau_needed_modeled"] - 1e-9


def test_cli_writes_the_head_tables_and_the_tau_plot(tmp_path):
    parser = argparse.ArgumentParser()
    cli.add_arguments(parser)
    out = tmp_path / "out"
    args = parser.parse_args(["spec", "--modeled-only", "--out", str(out), "--rig-root", str(RIGS / "not_rk3588"),
                              "--ms", "1,4"])
    assert cli.run(args) == 0
    report = json.loads((out / "spec.json").read_text())
    assert {r["head"] for r in report["raw"]["head_steps"]} == {"eagle3", "mtp"}
    assert len(report["raw"]["head_published"]) == len(sh.PUBLISHED)
    assert (out / "tok_s_vs_tau.png").is_file() and (out / "tok_s_vs_m.png").is_file()
    text = (out / "spec.md").read_text()
    assert "best --spec-draft-n-max" in text and "AngelSlim" in text
