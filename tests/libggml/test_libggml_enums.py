"""The generated ggml enum module: spot values from ggml-rpc.md and freshness against the pinned build."""

from __future__ import annotations

import pytest

from ggml_rknpu.codegen import ggml_enums as gen_enums
from ggml_rknpu.libggml import enums
from ggml_rknpu.toolchain import llamacpp
from ggml_rknpu.libggml.enums import GgmlGluOp, GgmlOp, GgmlType, GgmlUnaryOp


def test_spot_values_from_reference_note() -> None:
    # [ggml-rpc.md §5.2 / §3.3]: build enum order of the pinned llama.cpp
    assert (GgmlOp.MUL_MAT, GgmlOp.GET_ROWS, GgmlOp.SET_ROWS, GgmlOp.SOFT_MAX) == (29, 40, 42, 46)
    assert (GgmlOp.ROPE, GgmlOp.FLASH_ATTN_EXT, GgmlOp.UNARY, GgmlOp.GLU) == (48, 74, 91, 100)
    assert enums.GGML_OP_COUNT == 101 and len(GgmlOp) == 101
    assert enums.GGML_TYPE_COUNT == 43
    assert (GgmlType.F32, GgmlType.F16, GgmlType.Q4_0, GgmlType.Q5_0, GgmlType.Q8_0) == (0, 1, 2, 6, 8)
    assert (GgmlType.Q4_K, GgmlType.Q6_K, GgmlType.I32, GgmlType.I64, GgmlType.BF16) == (12, 14, 26, 27, 30)
    assert enums.RPC_PROTO == (7, 0, 0)
    assert enums.GGML_UNARY_OP_COUNT == 22 and len(GgmlUnaryOp) == 22
    assert enums.GGML_GLU_OP_COUNT == 7 and GgmlGluOp.SWIGLU == 2 and GgmlGluOp.GEGLU == 1


def test_type_traits_cover_live_types() -> None:
    assert set(enums.TYPE_TRAITS) == set(GgmlType)
    assert enums.TYPE_TRAITS[GgmlType.F32] == (1, 4)
    assert enums.TYPE_TRAITS[GgmlType.Q8_0] == (32, 34)
    assert enums.TYPE_TRAITS[GgmlType.Q4_K] == (256, 144)
    assert enums.TYPE_NAMES[GgmlType.Q4_K] == "q4_K"
    assert 4 not in {int(t) for t in GgmlType}   # Q4_2: removed from ggml


def test_parse_enum_follows_c_numbering() -> None:
    text = "enum e {\n A = 0,\n B, // x\n // C = 2 removed\n D = 6,\n E,\n E_COUNT,\n};"
    assert gen_enums.parse_enum(text, "e") == {"A": 0, "B": 1, "D": 6, "E": 7, "E_COUNT": 8}
    with pytest.raises(gen_enums.GenerationError):
        gen_enums.parse_enum("enum e { A = 1 << 2 };", "e")
    with pytest.raises(gen_enums.GenerationError):
        gen_enums.parse_enum("enum f { A };", "e")


def test_committed_module_matches_fresh_generation() -> None:
    try:
        llamacpp.source_dir()
        llamacpp.base_library()
    except llamacpp.LlamaCppNotBuilt as exc:
        pytest.skip(str(exc))
    assert gen_enums.generate() == gen_enums.OUTPUT.read_text(), "run scripts/gen-ggml-enums"


def test_a_client_with_other_enums_is_refused(tmp_path, capsys) -> None:
    """scripts/build-llama-cpp runs this check on every client build but the pinned one."""
    try:
        source, library = llamacpp.source_dir(), llamacpp.base_library()
    except llamacpp.LlamaCppNotBuilt as exc:
        pytest.skip(str(exc))
    args = ["--check", "--client", "other", "--library", str(library)]
    assert gen_enums.main([*args, "--source", str(source)]) == 0
    include = tmp_path / "ggml" / "include"
    include.mkdir(parents=True)
    (include / "ggml.h").write_text((source / "ggml" / "include" / "ggml.h").read_text())
    rpc_h = (source / "ggml" / "include" / "ggml-rpc.h").read_text()
    (include / "ggml-rpc.h").write_text(rpc_h.replace("RPC_PROTO_MAJOR_VERSION    7", "RPC_PROTO_MAJOR_VERSION    8"))
    assert gen_enums.main([*args, "--source", str(tmp_path)]) == 1
    err = capsys.readouterr().err
    assert "client other" in err and "-RPC_PROTO = (7, 0, 0)" in err and "+RPC_PROTO = (8, 0, 0)" in err
