"""Our choices against what the vendor runtime did for the same matmul: the captured
fp16 FC layer K=1024, N=1001 (one task on one core) [captures/decoded/c1024_h1_oc1001.json].

The vendor's first task computes the whole layer; ours does too, with the same CBUF
split, strides and sizes. Deliberate differences are listed with their reason."""

from __future__ import annotations

import json

from ggml_rknpu.compiler.matmul import compile_matmul
from ggml_rknpu.hw.regcmd import decode_word
from ggml_rknpu.hw.registers import BY_OFFSET, REGISTERS

# decoded-capture key -> our register
CAPTURE_KEYS = {
    "cbuf0": "CNA_CBUF_CON0", "data_size0": "CNA_DATA_SIZE0", "data_size1": "CNA_DATA_SIZE1",
    "data_size3": "CNA_DATA_SIZE3", "fc_data_size0": "CNA_FC_DATA_SIZE0", "fc_data_size1": "CNA_FC_DATA_SIZE1",
    "dma_con2": "CNA_DMA_CON2", "weight_size0": "CNA_WEIGHT_SIZE0", "weight_size1": "CNA_WEIGHT_SIZE1",
    "weight_size2": "CNA_WEIGHT_SIZE2", "conv_con1": "CNA_CONV_CON1", "conv_con2": "CNA_CONV_CON2",
    "core_dataout_size0": "CORE_DATAOUT_SIZE_0", "core_dataout_size1": "CORE_DATAOUT_SIZE_1",
    "dst_surf_stride": "DPU_DST_SURF_STRIDE", "data_cube_height": "DPU_DATA_CUBE_HEIGHT",
    "data_cube_channel": "DPU_DATA_CUBE_CHANNEL", "wdma_size0": "DPU_WDMA_SIZE_0",
    "wdma_size1": "DPU_WDMA_SIZE_1", "surface_add": "DPU_SURFACE_ADD",
}
# register -> (field, why ours differs)
DELIBERATE = {
    ("CNA_DATA_SIZE1", "DATAIN_CHANNEL_REAL"): "vendor writes 63 here whatever K; MTX (golden) writes K-1",
    ("CNA_WEIGHT_SIZE0", "WEIGHT_BYTES"): "we stream the zero-padded 1008 kernels (emit.py)",
    ("CNA_WEIGHT_SIZE2", "WEIGHT_KERNELS"): "padded kernel count 1008 vs the vendor's 1001 (emit.py)",
    ("DPU_DATA_CUBE_CHANNEL", "ORIG_CHANNEL"): "padded 1007 vs the vendor's N-1 = 1000 (emit.py)",
}


def test_fc_1024x1001_matches_vendor_task_modulo_listed_choices(reference_dir):
    cap = json.loads((reference_dir / "captures/decoded/c1024_h1_oc1001.json").read_text())
    vendor = cap["body_rows"][0]
    assert vendor["weight_size2"] & 0x3FFF == 1001                  # the whole layer in one task
    prog = compile_matmul(1, 1024, 1001, dtype="fp16", out="fp16")
    assert len(prog.tasks) == 1
    ours = {}
    for w in prog.words[: prog.tasks[0].body_words]:
        _t, value, offset = decode_word(int(w))
        ours[BY_OFFSET[offset].name] = value
    compared = 0
    for key, name in CAPTURE_KEYS.items():
        reg = REGISTERS[name]
        v_fields, o_fields = reg.decode(vendor[key]), reg.decode(ours[name])
        for field, v in v_fields.items():
            if (name, field) in DELIBERATE:
                assert o_fields[field] != v   # keep the list honest: remove entries that agree
                continue
            if name == "CNA_CONV_CON2" and field.startswith("RESERVED"):
                continue                       # blob's unexplained bits 28-30 on later tiles [§7]
            assert o_fields[field] == v, (name, field, o_fields[field], v)
            compared += 1
    assert compared > 40
