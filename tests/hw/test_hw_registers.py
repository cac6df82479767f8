"""The register database: generated table matches the XML, fields are sane, encode/decode."""

from __future__ import annotations

import subprocess
import sys
import xml.etree.ElementTree as ET

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ggml_rknpu.hw import limits
from ggml_rknpu.hw.registers import BY_OFFSET, REGISTERS, Block, block_of_offset, register_at

NS = "{http://nouveau.freedesktop.org/}"


def test_every_register_has_block_matching_offset_and_a_source():
    for reg in REGISTERS.values():
        assert block_of_offset(reg.offset) is reg.block, reg.name
        assert reg.name.startswith(reg.block.name + "_"), reg.name
        assert reg.source
        assert BY_OFFSET[reg.offset] is reg


def test_fields_do_not_overlap_and_stay_in_32_bits():
    for reg in REGISTERS.values():
        covered = 0
        for f in reg.fields:
            assert 0 <= f.lo <= f.hi <= 31, (reg.name, f)
            assert covered & f.mask == 0, (reg.name, f.name)
            covered |= f.mask
        assert len({f.name for f in reg.fields}) == len(reg.fields)


def test_known_fields_from_the_recipe():
    # [npu-programming.md §7] bit positions
    assert REGISTERS["CNA_CONV_CON1"].field("PROC_PRECISION") .lo == 7
    assert REGISTERS["CNA_CONV_CON2"].field("FEATURE_GRAINS").hi == 13
    assert REGISTERS["CNA_WEIGHT_SIZE2"].field("WEIGHT_KERNELS").width == 14
    assert REGISTERS["DPU_DATA_FORMAT"].field("OUT_PRECISION").lo == 29
    assert REGISTERS["PC_BASE_ADDRESS"].field("PC_SOURCE_ADDR").lo == 4
    assert register_at(0x100C).name == "CNA_CONV_CON1"
    assert register_at(0x5004).name == "DPU_RDMA_S_POINTER"
    assert register_at(0xF008).block is Block.GLOBAL


def test_undocumented_registers_present_with_source():
    for off in (0x3030, 0x40C4):
        reg = register_at(off)
        assert "undocumented" in reg.source and "§2" in reg.source


def test_encode_matches_the_section7_example():
    # fp16 CONV_CON1 = 0x120, DATA_SIZE1 (K=64) = 0x003F0040, DPU fp16->fp32 = 0xA8000002 [§7]
    assert REGISTERS["CNA_CONV_CON1"].encode(PROC_PRECISION=2, IN_PRECISION=2) == 0x120
    assert REGISTERS["CNA_DATA_SIZE1"].encode(DATAIN_CHANNEL_REAL=63, DATAIN_CHANNEL=64) == 0x003F0040
    assert REGISTERS["DPU_DATA_FORMAT"].encode(OUT_PRECISION=5, IN_PRECISION=2, PROC_PRECISION=2) == 0xA8000002
    assert REGISTERS["DPU_BS_OW_CFG"].encode(SIZE_E_2=3, SIZE_E_1=3, SIZE_E_0=3, OD_BYPASS=1) == 0x36E


def test_encode_rejects_out_of_range_and_unknown_fields():
    reg = REGISTERS["CNA_WEIGHT_SIZE2"]
    with pytest.raises(ValueError, match="WEIGHT_KERNELS"):
        reg.encode(WEIGHT_KERNELS=limits.MAX_WEIGHT_KERNELS + 1)
    with pytest.raises(ValueError, match="WEIGHT_KERNELS"):
        reg.encode(WEIGHT_KERNELS=-1)
    with pytest.raises(KeyError, match="NOPE"):
        reg.encode(NOPE=1)
    with pytest.raises(ValueError):
        reg.decode(1 << 32)


@settings(deadline=None)
@given(st.data())
def test_encode_decode_round_trip(data):
    reg = data.draw(st.sampled_from(sorted(REGISTERS.values(), key=lambda r: r.offset)))
    values = {f.name: data.draw(st.integers(0, f.max_value)) for f in reg.fields}
    word = reg.encode(**values)
    assert 0 <= word <= 0xFFFFFFFF
    assert reg.decode(word) == values


def test_generated_table_matches_xml(reference_dir, tmp_path):
    """Every reg32 of the XML is in the database with identical field bit ranges."""
    root = ET.parse(reference_dir / "registers.xml").getroot()
    n = 0
    for domain in root.findall(f"{NS}domain"):
        for reg in domain.findall(f"{NS}reg32"):
            ours = BY_OFFSET[int(reg.get("offset", ""), 16)]
            assert ours.block is Block[domain.get("name", "")]
            for bf in reg.findall(f"{NS}bitfield"):
                lo = int(bf.get("pos") or bf.get("low") or "")
                hi = int(bf.get("pos") or bf.get("high") or "")
                f = ours.field(bf.get("name", ""))
                assert (f.lo, f.hi) == (lo, hi), (ours.name, f)
            n += 1
    assert n == len(REGISTERS) - 2   # + the two undocumented registers


def test_generator_is_reproducible(reference_dir, tmp_path):
    """Re-running the generator on the reference XML reproduces the committed table."""
    from pathlib import Path

    repo = Path(__file__).resolve().parents[2]
    out = tmp_path / "table.py"
    subprocess.run([sys.executable, str(repo / "scripts/gen-hw-registers"),
                    str(reference_dir / "registers.xml"), "--output", str(out)],
                   check=True, capture_output=True)
    assert out.read_text() == (repo / "src/ggml_rknpu/hw/_register_table.py").read_text()
