"""``rknpu bench fit``: the goals hold as modeled (Qwen3-4B Q4_K_M fits 8 GB with NPU prefill; an
8B Q4_K_M fits 16 GB with its weights NPU-resident, marked as needing multi-domain residency);
a row per RAM size and plan; the per-weight mix never exceeds its limits and is never slower
than host-only; the byte model's arithmetic."""

from __future__ import annotations

import json

import pytest

from ggml_rknpu.bench import fit, fit_bytes, plans
from ggml_rknpu.bench.fit_bytes import NPU_DOMAIN_BYTES, Footprint, gguf_bytes, npu_bytes, usable

MB = 1e6


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    from ggml_rknpu.cli.main import main

    out = tmp_path_factory.mktemp("fit")
    assert main(["bench", "fit", "Qwen3-4B", "Llama-3.1-8B", "Qwen3-0.6B", "--allow-throttled", "--out", str(out)]) == 0
    return json.loads((out / "fit.json").read_text())["raw"]["rows"], (out / "fit.md").read_text()


def _row(rows, model, ram, plan):
    return next(r for r in rows if (r["model"], r["ram_gb"], r["plan"]) == (model, ram, plan))


def test_a_row_per_ram_size_and_plan(report):
    rows, md = report
    plans_ = ["llama.cpp alone", "serve host only", "serve NPU only", "serve auto (both)", "serve budget",
              "serve budget, one domain"]
    for model in ("Qwen3-4B", "Llama-3.1-8B"):
        assert [(r["ram_gb"], r["plan"]) for r in rows if r["model"] == model] == [
            (ram, p) for ram in fit.RAM_GB for p in plans_]
    assert "(modeled)" in md and "multi-domain NPU residency: the vendor driver's domains, or on rocket a file per core (a 4 GiB window per core)" in md


def test_qwen3_4b_fits_8_gb_with_npu_prefill(report):
    rows, _ = report
    budget, alone = _row(rows, "Qwen3-4B", 8, "serve budget"), _row(rows, "Qwen3-4B", 8, "llama.cpp alone")
    assert budget["fits"] == "yes" and budget["npu_gib_modeled"] * 2**30 <= NPU_DOMAIN_BYTES
    assert budget["prefill512_tok_s_modeled"] > 10 * alone["prefill512_tok_s_modeled"]
    for ram in fit.RAM_GB:       # wherever llama.cpp alone fits, so does the server (toward host only)
        if _row(rows, "Qwen3-4B", ram, "llama.cpp alone")["fits"] == "yes":
            assert _row(rows, "Qwen3-4B", ram, "serve budget")["fits"] == "yes"


def test_an_8b_fits_16_gb_npu_resident_only_across_domains(report):
    rows, _ = report
    budget = _row(rows, "Llama-3.1-8B", 16, "serve budget")
    auto = _row(rows, "Llama-3.1-8B", 16, "serve auto (both)")
    assert budget["fits"] == "yes" and budget["prefill512_tok_s_modeled"] == auto["prefill512_tok_s_modeled"]
    assert budget["npu_gib_modeled"] * 2**30 > NPU_DOMAIN_BYTES and "multi-domain" in budget["note"]
    one = _row(rows, "Llama-3.1-8B", 16, "serve budget, one domain")
    assert one["npu_gib_modeled"] * 2**30 <= NPU_DOMAIN_BYTES and "multi-domain" not in one["note"]
    assert one["prefill512_tok_s_modeled"] < budget["prefill512_tok_s_modeled"]


def test_rkllm_rows_only_where_its_table_has_the_model(report):
    rows, _ = report
    rk = [r for r in rows if r["plan"] == "RKLLM (published)"]
    assert {r["model"] for r in rk} == {"Qwen3-0.6B"}
    assert all(r["board_gib_modeled"] == pytest.approx(791.11 * MB / 2**30) for r in rk)


@pytest.mark.parametrize("ram", fit.RAM_GB)
def test_the_mix_stays_within_its_limits_and_beats_host_only(ram):
    shape = fit_bytes.SHAPES["Llama-3.1-8B"]
    weights = plans.preset_weights(shape, "Q4_K_M")
    us = fit.units(weights, "int8", 3)
    fp = Footprint(shape, 4096, gguf_bytes(weights[-1]))
    for window in (None, NPU_DOMAIN_BYTES):
        sides = fit.fastest_within(us, usable(ram), window, fp.served)
        if sides is None:
            assert fp.served(sum(u.cost.host_bytes for u in us), 0) > usable(ram)
            continue
        host, npu, t = fit.totals(us, sides)
        assert fp.served(host, npu) <= usable(ram) and (window is None or npu <= window)
        assert sum(u.cost.job_s(s) for u, s in zip(us, sides)) <= sum(u.cost.job_s(fit.HOST) for u in us)


def test_byte_model_arithmetic():
    w = plans.Weight("gate", 4096, 14336, "Q4_K", 1)
    assert gguf_bytes(w) == 14336 * 4096 // 256 * 144
    assert npu_bytes(w, "int8") == 14336 * 4096 + 14336 * 4 and npu_bytes(w, "fp16") == 14336 * 4096 * 2
    shape = fit_bytes.SHAPES["Qwen3-4B"]
    assert Footprint(shape, 4096, 0).kv == 2 * 36 * 1024 * 4096 * 2
    assert usable(8) == int(8 * 2**30 * 0.96) - int(8 * 2**30 * 0.96) // 8


def test_kv_counts_attention_layers_and_the_sliding_window():
    """Qwen3.5-9B: K and V on its 8 full-attention layers only, plus 24 delta-net states;
    Gemma3-1B: the whole context on its 4 global layers, window + a batch on the 22 sliding."""
    from ggml_rknpu.bench.shapes import PRESETS

    qwen = PRESETS["Qwen3.5-9B"]
    fp = Footprint(qwen, 4096, 0)
    assert fp.kv == 2 * 8 * (4 * 256) * 4096 * 2
    d = qwen.delta
    assert d is not None and fp.recurrent == 24 * ((d.conv_kernel - 1) * d.conv_channels + 128 * 32 * 128) * 4
    assert 48 << 20 < fp.recurrent < 52 << 20                   # ~50 MiB: 32 value heads' 128 x 128 f32 states
    gemma = Footprint(PRESETS["Gemma3-1B"], 8192, 0)
    assert gemma.kv == 2 * 256 * (4 * 8192 + 22 * (512 + 512)) * 2 and gemma.recurrent == 0


def test_a_gguf_is_priced_in_its_stored_types(tmp_path):
    from ggml_rknpu.cli.main import main
    from support.gguf_models import write_tiny_gguf

    path = write_tiny_gguf(tmp_path / "tiny.gguf", "llama")
    assert main(["bench", "fit", str(path), "--ram", "4", "--allow-throttled", "--out", str(tmp_path / "out")]) == 0
    rows = json.loads((tmp_path / "out" / "fit.json").read_text())["raw"]["rows"]
    assert {r["quant"] for r in rows} == {"as stored"} and {r["model"] for r in rows} == {"tiny"}
    assert all(r["fits"] == "yes" for r in rows)
    assert fit.resolve("qwen3-0.6b")[1] is None                     # a preset in any case, as bench decode
    with pytest.raises(ValueError, match="neither a preset"):
        fit.resolve("no-such-model")
