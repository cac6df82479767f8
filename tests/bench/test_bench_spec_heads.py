"""rknpu bench spec, heads: the head shapes follow llama.cpp's tensors, a round is the target's
verification plus the head's passes priced by bench.plans, the auto plan and the head's
placement are cost.placement's argmin, the chain model inverts, and the goals' acceptance
length is what the round costs say."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from ggml_rknpu.bench import plans
from ggml_rknpu.bench import spec_heads as sh
from ggml_rknpu.bench.spec_shapes import PRESET_DIMS
from ggml_rknpu.cli import bench as cli
from ggml_rknpu.cost import cpu
from ggml_rknpu.cost import host_ops as ho
from ggml_rknpu.cost import placement as pl

RIGS = Path(__file__).resolve().parents[1] / "fixtures" / "rigs"
DIMS = PRESET_DIMS["qwen2.5-1.5b"]
BOARD = sh.Board("int8", 3)
SHAPES = sh.heads_for(DIMS, "qwen2.5-1.5b")
TARGET = sh.priced(sh.target_for(DIMS, "qwen2.5-1.5b", "test"), "Q4_0")
Q4_0 = TARGET
HEADS = {kind: sh.priced(shape, "Q4_0") for kind, shape in SHAPES.items()}


def _kn(head: sh.HeadShape) -> dict[str, tuple[int, int]]:
    return {w.name: (w.K, w.N) for w in plans.preset_weights(head, "Q4_0")}


def test_eagle3_head_is_fc_one_layer_on_two_inputs_and_the_draft_vocab():
    kn = _kn(SHAPES["eagle3"])
    assert kn["fc"] == (3 * 1536, 1536)                   # fc over 3 target layers
    assert kn["q"] == (2 * 1536, 12 * 128)                # q reads [embedding; features]
    assert kn["k"] == kn["v"] == (2 * 1536, 2 * 128)
    assert kn["gate"] == kn["up"] == (1536, 8960) and kn["down"] == (8960, 1536)
    assert kn["output"] == (1536, sh.EAGLE3_DRAFT_VOCAB)
    assert sum(w.count for w in HEADS["eagle3"].weights) == 9 and len(HEADS["eagle3"].host) == 1


def test_mtp_head_is_eh_proj_one_target_layer_and_the_full_head():
    kn = _kn(SHAPES["mtp"])
    assert kn["eh_proj"] == (2 * 1536, 1536)
    assert kn["q"] == (1536, 12 * 128)
    assert kn["output"] == (1536, 151936)                  # the shared full-vocabulary head
    assert sum(w.count for w in HEADS["mtp"].weights) == 1 + 7 + 1


def test_head_weight_types_follow_llama_cpps_quantizer():
    types = {w.name: w.type for w in HEADS["eagle3"].weights}
    assert types["fc"] == types["q"] == "Q4_0" and types["output"] == "Q6_K"
    q8 = {w.name: w.type for w in sh.priced(SHAPES["eagle3"], "Q8_0").weights}
    assert set(q8.values()) == {"Q8_0"}


@pytest.mark.parametrize("plan", sh.SPEC_PLANS)
def test_round_is_verification_plus_the_head_passes_with_host_ops(plan):
    head = HEADS["eagle3"]
    for n in (1, 3, 7):
        kw: dict = dict(npu_dtype="int8", cores=3, past=plans.DECODE_PAST)
        want = (plans.pass_seconds(list(TARGET.weights), TARGET.host, plan, n + 1, **kw)
                + n * plans.pass_seconds(list(head.weights), head.host, plan, 1, **kw)
                + plans.pass_seconds(list(head.weights), head.host, plan, n + 1, **kw))
        assert sh.round_s(TARGET, head, n, plan, BOARD) == pytest.approx(want)
    # host ops are in every pass: one layer's for the head, 28 layers' for the target
    assert len(head.host) == 1 and len(TARGET.host) == 28
    assert sh.pass_s(head, plan, 1, BOARD) > ho.host_ops_seconds(head.host, 1, plans.DECODE_PAST)
    assert sh.pass_s(TARGET, plan, 1, BOARD) > ho.host_ops_seconds(TARGET.host, 1, plans.DECODE_PAST)
    # the head is far cheaper than the target: one layer and a 32k head against 28 layers and a 152k head
    assert sh.pass_s(head, plan, 1, BOARD) < 0.1 * sh.pass_s(TARGET, plan, 1, BOARD)


def test_auto_is_never_slower_than_the_npu_or_the_servers_host_path():
    """auto takes each matmul's argmin of the NPU and the server's host path (the GGUF bytes
    unrepacked), so its pass is never above either pure placement at any M."""
    for model in (TARGET, *HEADS.values()):
        for M in range(1, max(sh.DRAFT_NS) + 2):
            auto = sh.pass_s(model, "auto", M, BOARD)
            assert auto <= sh.pass_s(model, "npu", M, BOARD) + 1e-12
            host = sum(w.count * pl.host_matmul_seconds(w.type, M, w.K, w.N, cpu.BIG_CORES) for w in model.weights)
            assert auto <= host + ho.host_ops_seconds(model.host, M, plans.DECODE_PAST) + 1e-12
            assert sh.pass_s(model, "auto-split", M, BOARD) <= auto + 1e-12


def test_auto_against_llama_cpp_alone():
    """llama.cpp alone repacks Q4_0 (q4_0_4x4), and so does the server's host path (repacked
    host copies): at M = 1 every matmul streams its Q4_0 bytes faster from the host, so auto
    is llama.cpp alone; from M = 2 on auto also uses the NPU and is faster."""
    for M in range(1, max(sh.DRAFT_NS) + 2):
        auto, alone = sh.pass_s(TARGET, "auto", M, BOARD), sh.pass_s(TARGET, "cpu", M, BOARD)
        assert auto == alone if M == 1 else auto < alone


def test_head_placement_is_the_argmin_of_the_two_models():
    for head in HEADS.values():
        placed = plans.place(list(head.weights), "auto", 1, npu_dtype="int8", cores=3)
        for p in placed:
            w = p.weight
            npu = pl.npu_matmul_seconds(1, w.K, w.N, "int8", 3)
            host = pl.host_matmul_seconds(w.type, 1, w.K, w.N, cpu.BIG_CORES, repacked=True)   # host copies
            assert p.where == (pl.NPU if npu <= host else pl.HOST)
            assert p.seconds == pytest.approx(min(npu, host))
        # at M = 1 the CPU takes most of the head (bandwidth: Q4_0 streams fewer bytes than int8)
        assert sum(p.weight.count for p in placed if p.where == pl.HOST) > len(placed) // 2
    assert sh.placement_of(HEADS["eagle3"], "cpu", 1, BOARD) == pl.HOST
    assert sh.placement_of(HEADS["eagle3"], "npu", 1, BOARD) == pl.NPU


def test_round_rows_cover_every_plan_and_length():
    rows = sh.round_rows(TARGET, HEADS, BOARD)
    assert len(rows) == len(HEADS) * len(sh.DRAFT_NS) * len(sh.SPEC_PLANS)
    by = {(r["head"], r["n_draft"], r["plan"]): r for r in rows}
    for (kind, n, plan), r in by.items():
        assert r["round_ms_modeled"] == pytest.approx(sh.round_s(TARGET, HEADS[kind], n, plan, BOARD) * 1e3)
        assert r["ceiling_tok_s_modeled"] == pytest.approx((n + 1) / r["round_ms_modeled"] * 1e3)
        if plan == "auto":
            assert r["round_ms_modeled"] <= by[(kind, n, "npu")]["round_ms_modeled"] + 1e-9


def test_chain_model_and_its_inverse():
    assert sh.chain_tau(0.0, 5) == 1.0 and sh.chain_tau(1.0, 5) == 6.0
    assert sh.chain_tau(0.5, 2) == pytest.approx(1 + 0.5 + 0.25)
    alpha = sh.alpha_from_tau(2.17)
    assert sh.chain_tau(alpha, 1000) == pytest.approx(2.17)
    assert all(sh.chain_tau(alpha, n) < 2.17 for n in sh.DRAFT_NS)     # the lower bound: short chains accept less
    assert sh.chain_tau(sh._alpha_for(3.0, 4), 4) == pytest.approx(3.0)


def test_published_rows_carry_their_source_and_pick_the_best_length():
    rows = sh.published_rows(TARGET, HEADS, BOARD, rkllm=16.7, q4_0=Q4_0)
    assert len(rows) == len(sh.PUBLISHED) * len(sh.SPEC_PLANS)
    assert all(r["source"] for r in rows)
    plain = 1.0 / sh.pass_s(TARGET, "cpu", 1, BOARD)
    for row in rows:
        pub = next(p for p in sh.PUBLISHED if p.model == row["model"])
        alpha = sh.alpha_from_tau(pub.tau)
        by_n = {n: sh.chain_tau(alpha, n) / sh.round_s(TARGET, HEADS[pub.head], n, row["plan"], BOARD)
                for n in sh.DRAFT_NS}
        assert row["best_n_draft"] == max(by_n, key=lambda n: by_n[n])
        assert row["tok_s_modeled"] == pytest.approx(by_n[row["best_n_draft"]])
        assert row["vs_rkllm_modeled"] == pytest.approx(row["tok_s_modeled"] / 16.7)
        assert row["vs_cpu_plain_modeled"] == pytest.approx(row["tok_s_modeled"] / plain)


def test_needed_tau_meets_the_goal_exactly_and_the_best_plan_needs_least():
    rows = sh.needed_rows(TARGET, HEADS, BOARD, rkllm=16.7, q4_0=Q4_0)
    goals = sh.goals(TARGET, Q4_0, BOARD, 16.7)
    assert goals["2.5x RKLLM"] == pytest.approx(41.75)
    assert goals["1.5x CPU Q4_0 (this target, modeled)"] == pytest.approx(1.5 / sh.pass_s(TARGET, "cpu", 1, BOARD))
    assert {(r["head"], r["goal"], r["plan"]) for r in rows} == {
        (h, g, p) for h in HEADS for g in goals for p in sh.SPEC_PLANS}
    for r in rows:
        if r["tau_needed_modeled"] is None:
            # unreachable: at every length the goal needs more than n + 1 tokens a round
            assert all(r["goal_tok_s"] * sh.round_s(TARGET, HEADS[r["head"]], n, r["plan"], BOARD) > n + 1
                       for n in sh.DRAFT_NS)
            continue
        cost = sh.round_s(TARGET, HEADS[r["head"]], r["n_draft"], r["plan"], BOARD)
        assert r["tau_needed_modeled"] / cost == pytest.approx(r["goal_tok_s"])
        assert r["tau_needed_modeled"] <= r["n_draft"] + 1
    for head in HEADS:
        for goal in goals:
            group = [r for r in rows if r["head"] == head and r["goal"] == goal and r["plan"] in sh.RUNNABLE
                     and r["tau_needed_modeled"] is not None]
            best = [r for r in group if r["best_plan"]]
            assert len(best) == 1 and best[0]["tau_needed_modeled"] == min(r["tau_needed_modeled"] for r in group)


def test_cli_writes_the_head_tables_and_the_tau_plot(tmp_path):
    parser = argparse.ArgumentParser()
    cli.add_arguments(parser)
    out = tmp_path / "out"
    args = parser.parse_args(["spec", "--modeled-only", "--out", str(out), "--rig-root", str(RIGS / "not_rk3588"),
                              "--ms", "1,4", "--quant", "Q4_K_M"])
    assert cli.run(args) == 0
    report = json.loads((out / "spec.json").read_text())
    assert {r["head"] for r in report["raw"]["head_rounds"]} == {"eagle3", "mtp"}
    assert {r["plan"] for r in report["raw"]["head_rounds"]} == set(sh.SPEC_PLANS)
    assert len(report["raw"]["head_published"]) == len(sh.PUBLISHED) * len(sh.SPEC_PLANS)
    assert report["meta"]["quant"] == "Q4_K_M"
    assert report["raw"]["cpu_plain_tok_s_modeled"] < report["raw"]["cpu_q4_0_plain_tok_s_modeled"]
    assert (out / "tok_s_vs_tau.png").is_file() and (out / "tok_s_vs_m.png").is_file()
    text = (out / "spec.md").read_text()
    assert "best --spec-draft-n-max" in text and "AngelSlim" in text and "Q4_K_M" in text
