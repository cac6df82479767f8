"""All 83 decoded vendor captures (captures/decoded/*.json) satisfy the simulator's rules:
every body row's register fields pass each rule whose registers the row carries, and the
rules that matter for these rows are actually exercised (not skipped)."""

from __future__ import annotations

import json

import pytest

from ggml_rknpu.sim.validate import validate_fields

# JSON key -> register database name [captures/README.md field list]
KEYS = {
    "cbuf0": "CNA_CBUF_CON0", "data_size0": "CNA_DATA_SIZE0", "data_size1": "CNA_DATA_SIZE1",
    "data_size3": "CNA_DATA_SIZE3", "fc_data_size0": "CNA_FC_DATA_SIZE0",
    "fc_data_size1": "CNA_FC_DATA_SIZE1", "dma_con2": "CNA_DMA_CON2",
    "weight_size0": "CNA_WEIGHT_SIZE0", "weight_size1": "CNA_WEIGHT_SIZE1",
    "weight_size2": "CNA_WEIGHT_SIZE2", "conv_con1": "CNA_CONV_CON1", "conv_con2": "CNA_CONV_CON2",
    "core_dataout_size0": "CORE_DATAOUT_SIZE_0", "core_dataout_size1": "CORE_DATAOUT_SIZE_1",
    "dst_base": "DPU_DST_BASE_ADDR", "feature_data_addr": "CNA_FEATURE_DATA_ADDR",
    "dcomp_addr": "CNA_DCOMP_ADDR0", "dst_surf_stride": "DPU_DST_SURF_STRIDE",
    "data_cube_height": "DPU_DATA_CUBE_HEIGHT", "data_cube_channel": "DPU_DATA_CUBE_CHANNEL",
    "wdma_size0": "DPU_WDMA_SIZE_0", "wdma_size1": "DPU_WDMA_SIZE_1",
    "surface_add": "DPU_SURFACE_ADD",
}
# Rules every complete decoded row must exercise (its registers are all in the JSON).
MUST_CHECK = {"field-range", "rule_cbuf_banks", "rule_cbuf_input", "rule_weight_size",
              "rule_dma_size", "rule_surf_stride", "rule_output_shape", "rule_surface_add",
              "rule_alignment", "rule_conv_mode", "rule_feature_grains"}


def test_decoded_task_tables_use_what_the_simulator_runs(reference_dir):
    """Every captured task is a conv (op-enable 0x0D) or a PPU separator (0x60) -- the two
    task kinds the simulator executes -- and every regcmd address is 16-byte aligned
    (PC_SOURCE_ADDR is bits 31:4 [§2])."""
    masks, tasks = set(), 0
    for f in sorted((reference_dir / "captures" / "decoded").glob("*.json")):
        doc = json.loads(f.read_text())
        assert len(doc["regcmd_addrs"]) == doc["task_count"]
        masks |= set(doc["masks"])
        assert all(int(a, 16) % 16 == 0 for a in doc["regcmd_addrs"]), f.stem
        tasks += doc["task_count"]
    assert masks == {0x0D, 0x60} and tasks > 1000


def _rows(reference_dir):
    files = sorted((reference_dir / "captures" / "decoded").glob("*.json"))
    assert len(files) == 83
    for f in files:
        doc = json.loads(f.read_text())
        assert doc["task_count"] == len(doc["amounts"]) == len(doc["masks"])
        for i, row in enumerate(doc["body_rows"]):
            yield f.stem, i, {KEYS[k]: v for k, v in row.items()}


def test_all_decoded_captures_pass_the_rules(reference_dir):
    failures, complete_rows = [], 0
    for stem, i, fields in _rows(reference_dir):
        report = validate_fields(fields)
        failures += [f"{stem}[{i}]: {v.describe()}" for v in report.violations]
        if all(v is not None for v in fields.values()):
            complete_rows += 1
            missing = MUST_CHECK - set(report.checked)
            assert not missing, f"{stem}[{i}] skipped {missing}: {report.skipped} {report.not_modeled}"
    assert not failures, "\n".join(failures[:20])
    assert complete_rows >= 600


@pytest.mark.parametrize("key, value, rule", [
    ("cbuf0", 0x8C, "cbuf-banks"),                 # 8 weight + 12 data banks
    ("dma_con2", 100, "feature-strides"),          # SURF_STRIDE not W*(H-4)
    ("surface_add", 0x1890, "surface-add"),        # breaks the S rule
    ("data_size0", 0x000E0800 | 14, "field-range"),  # height 2062 spills into reserved bits
    ("dst_base", 0xFFEC8008, "alignment"),
])
def test_a_broken_field_in_a_real_row_is_caught(reference_dir, key, value, rule):
    """The same rules do fire on a vendor row once one field is broken (they can fail)."""
    stem, i, fields = next(r for r in _rows(reference_dir) if r[0] == "c256_h3_oc128_s1pvalid")
    assert validate_fields(fields).violations == []
    fields = dict(fields, **{KEYS[key]: value})
    rules = {v.rule for v in validate_fields(fields).violations}
    assert rule in rules, rules
