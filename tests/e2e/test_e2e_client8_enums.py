"""b11739's ggml enums against ours (generated from the pinned build): a client whose op or type
numbers differed would have its graphs run as other ops. Sources: the wheel's CFFI declarations
(``enum ggml_type`` with its COUNT) and its own ``libggml-base`` (``ggml_op_name``,
``ggml_unary_op_name``, ``ggml_glu_op_name``, ``ggml_type_name``, ``ggml_blck_size``,
``ggml_type_size`` at every value). The op count is fixed by protocol 8.0.0 itself:
``ggml-rpc.h`` keeps ``static_assert(GGML_OP_COUNT == 101)`` (docs/ggml-rpc.md §4). Tensor flags
are checked on the client's real graphs in test_e2e_client8_replay.py.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from ggml_rknpu.codegen import ggml_enums
from ggml_rknpu.libggml import enums
from ggml_rknpu.libggml.enums import TYPE_NAMES, TYPE_TRAITS, GgmlGluOp, GgmlOp, GgmlType, GgmlUnaryOp
from support import wheel_client


@pytest.fixture(scope="module")
def client() -> wheel_client.Client:
    try:
        return wheel_client.client()
    except wheel_client.WheelUnavailable as exc:
        pytest.skip(str(exc))


_NAMES = r"""
import ctypes, json, sys
from pathlib import Path
import llama_cpp_py_sync
lib = ctypes.CDLL(str(Path(llama_cpp_py_sync.__file__).with_name("libggml-base.so.0")))
counts = json.loads(sys.argv[1])
out = {}
for fn in ("ggml_op_name", "ggml_unary_op_name", "ggml_glu_op_name", "ggml_type_name"):
    getattr(lib, fn).restype, getattr(lib, fn).argtypes = ctypes.c_char_p, [ctypes.c_int]
    out[fn] = [(getattr(lib, fn)(i) or b"").decode() for i in range(counts[fn])]
for fn in ("ggml_blck_size", "ggml_type_size"):
    getattr(lib, fn).restype, getattr(lib, fn).argtypes = ctypes.c_int64, [ctypes.c_int]
    out[fn] = [getattr(lib, fn)(i) for i in json.loads(sys.argv[2])]
print(json.dumps(out))
"""


def _wheel_names(client: wheel_client.Client) -> dict:
    counts = {"ggml_op_name": enums.GGML_OP_COUNT, "ggml_unary_op_name": enums.GGML_UNARY_OP_COUNT,
              "ggml_glu_op_name": enums.GGML_GLU_OP_COUNT, "ggml_type_name": enums.GGML_TYPE_COUNT}
    live = [int(t) for t in GgmlType]
    proc = subprocess.run([sys.executable, "-c", _NAMES, json.dumps(counts), json.dumps(live)], env=client.env(),
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout)


def test_type_enum_declared_by_the_wheel_equals_ours(client) -> None:
    declared = Path(client.pythonpath, wheel_client.PACKAGE, "_cffi_bindings.py").read_text()
    parsed = ggml_enums.parse_enum(declared, "ggml_type")
    ours = {f"GGML_TYPE_{t.name}": int(t) for t in GgmlType} | {"GGML_TYPE_COUNT": enums.GGML_TYPE_COUNT}
    assert parsed == ours


def test_op_unary_glu_and_type_names_of_the_wheels_ggml_equal_ours(client) -> None:
    got = _wheel_names(client)
    assert got["ggml_op_name"] == [GgmlOp(i).name for i in range(enums.GGML_OP_COUNT)]
    assert got["ggml_unary_op_name"] == [GgmlUnaryOp(i).name for i in range(enums.GGML_UNARY_OP_COUNT)]
    assert got["ggml_glu_op_name"] == [GgmlGluOp(i).name for i in range(enums.GGML_GLU_OP_COUNT)]
    live = list(GgmlType)
    names = got["ggml_type_name"]
    assert [names[int(t)] for t in live] == [TYPE_NAMES[t] for t in live]
    assert list(zip(got["ggml_blck_size"], got["ggml_type_size"])) == [TYPE_TRAITS[t] for t in live]
