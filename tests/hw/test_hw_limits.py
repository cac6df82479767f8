"""Limits: derived field limits equal the §9 table; CBUF arithmetic equals the TRM's 384 KB."""

from __future__ import annotations

from ggml_rknpu.hw import limits


def test_field_limits_match_section9_table():
    assert limits.MAX_DATAIN_HEIGHT == limits.MAX_DATAIN_WIDTH == 2047
    assert limits.MAX_WEIGHT_KERNELS == 16383
    assert limits.MAX_DPU_CUBE == limits.MAX_DPU_HEIGHT == 8192      # 13-bit fields hold n-1
    assert limits.MAX_FEATURE_GRAINS == 1023
    assert limits.MAX_TASKS_PER_SUBMIT == 4095
    assert limits.MAX_WEIGHT_BYTES_PER_KERNEL == (1 << 19) - 1
    assert limits.MAX_DATAOUT_ATOMICS == (1 << 22) - 1


def test_cbuf_geometry():
    assert limits.CBUF_BANKS * limits.CBUF_BANK_BYTES == 384 * 1024                       # [TRM 36.1]
    assert limits.CBUF_ENTRIES_PER_BANK * limits.CBUF_ENTRY_BYTES == limits.CBUF_BANK_BYTES
    # §9: fp16 M_task <= 180224 / Kp, e.g. 44 rows at K=4096 and 176 at K=1024 with 11 data banks
    assert limits.MAX_DATA_BANKS * limits.CBUF_BANK_BYTES // (4096 * 2) == 44
    assert limits.MAX_DATA_BANKS * limits.CBUF_BANK_BYTES // (1024 * 2) == 176


def test_atoms_and_precisions():
    assert (limits.c2("fp16"), limits.c2("int8"), limits.c2("fp32"), limits.c2("int32")) == (8, 16, 4, 4)
    assert limits.KERNEL_GROUP == {"fp16": 16, "int8": 32}
    assert limits.CNA_PRECISION["fp16"] == 2 and limits.CNA_PRECISION["int8"] == 0
    assert (limits.DPU_PRECISION["int32"], limits.DPU_PRECISION["fp32"]) == (4, 5)
    assert "int32" not in limits.CNA_PRECISION          # CNA/CORE have no 32-bit input codes [§1]
