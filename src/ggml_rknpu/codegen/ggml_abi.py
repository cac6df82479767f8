"""Generator of ``ggml_rknpu/libggml/abi.py`` from the pinned ggml headers (``scripts/gen-ggml-abi``).

Why generated: the binding reads and writes ``struct ggml_tensor`` fields directly (a plan
builds ggml tensors whose ``data`` points into the server's buffers), and passes
``ggml_cplan`` / ``ggml_threadpool_params`` / ``ggml_init_params`` by value or pointer. Their
layout is the build's, so it is parsed from the very headers the pinned libraries were built
from, never typed in by hand; ``libggml.lib`` then checks the result against the loaded
library at start (``ggml_tensor_overhead``, field round trips), so a stale file refuses to run.

The parser understands exactly the C the selected structs use (scalars, enums, pointers,
function-pointer typedefs, fixed arrays whose size is a ``#define`` expression); anything else
is a :class:`GenerationError`, never a guess.
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

from ggml_rknpu.toolchain import llamacpp
from ggml_rknpu.codegen.ggml_enums import parse_enum

OUTPUT = Path(__file__).resolve().parent.parent / "libggml" / "abi.py"

# (C struct, file relative to ggml/, Python class name)
STRUCTS = (
    ("ggml_init_params", "include/ggml.h", "InitParams"),
    ("ggml_tensor", "include/ggml.h", "Tensor"),
    ("ggml_type_traits", "include/ggml.h", "TypeTraits"),
    ("ggml_threadpool_params", "include/ggml.h", "ThreadpoolParams"),
    ("ggml_cplan", "include/ggml-cpu.h", "Cplan"),
    ("ggml_type_traits_cpu", "include/ggml-cpu.h", "TypeTraitsCpu"),
    ("ggml_object", "src/ggml.c", "Object"),        # private to ggml.c: only its size is used
)
DEFINES = ("GGML_MAX_DIMS", "GGML_MAX_SRC", "GGML_MAX_OP_PARAMS", "GGML_MAX_NAME", "GGML_MAX_N_THREADS",
           "GGML_MROPE_SECTIONS", "GGML_ROPE_TYPE_NORMAL", "GGML_ROPE_TYPE_NEOX", "GGML_ROPE_TYPE_MROPE",
           "GGML_ROPE_TYPE_VISION", "GGML_ROPE_TYPE_IMROPE")
# enums whose values travel in op_params (checked by the validator's rules) or in tensor flags
ENUMS = ("ggml_tensor_flag", "ggml_prec", "ggml_op_hint", "ggml_tri_type", "ggml_op_pool", "ggml_scale_mode",
         "ggml_scale_flag", "ggml_sort_order")

_SCALARS = {
    "int64_t": "ctypes.c_int64", "uint64_t": "ctypes.c_uint64", "int32_t": "ctypes.c_int32",
    "uint32_t": "ctypes.c_uint32", "size_t": "ctypes.c_size_t", "int": "ctypes.c_int",
    "bool": "ctypes.c_bool", "char": "ctypes.c_char", "float": "ctypes.c_float",
}
_FUNCTION_TYPEDEFS = ("ggml_abort_callback", "ggml_to_float_t", "ggml_from_float_t", "ggml_vec_dot_t")
_C_SIZES = {"int32_t": 4, "int64_t": 8, "float": 4}


class GenerationError(RuntimeError):
    """A header could not be parsed as expected."""


def parse_defines(text: str) -> dict[str, int]:
    out: dict[str, int] = {}
    for name in DEFINES:
        m = re.search(r"#\s*define\s+" + name + r"\s+(\d+)", text)
        if not m:
            raise GenerationError(f"#define {name} not found")
        out[name] = int(m.group(1))
    return out


def _array_size(expr: str, defines: dict[str, int]) -> int:
    def sizeof(m: re.Match) -> str:
        return str(_C_SIZES[m.group(1)])
    expr = re.sub(r"sizeof\((\w+)\)", sizeof, expr)
    expr = re.sub(r"[A-Z_][A-Z0-9_]+", lambda m: str(defines[m.group(0)]), expr)
    if not re.fullmatch(r"[\d\s*/+-]+", expr):
        raise GenerationError(f"array size {expr!r} is not a constant expression")
    return int(eval(expr.replace("/", "//")))   # digits and arithmetic only (checked above)


def _ctype(decl: str, struct: str) -> str:
    decl = re.sub(r"\bconst\b", "", decl).strip()
    if "*" in decl:
        base = decl.replace("*", "").strip()
        if base == "struct ggml_tensor":
            return "ctypes.POINTER(Tensor)" if struct == "ggml_tensor" else "ctypes.c_void_p"
        if base == "char":
            return "ctypes.c_char_p"
        return "ctypes.c_void_p"
    if decl.startswith("enum "):
        return "ctypes.c_int"                     # C enums without a fixed type are int (ggml.h)
    if decl in _FUNCTION_TYPEDEFS:
        return "ctypes.c_void_p"
    if decl in _SCALARS:
        return _SCALARS[decl]
    raise GenerationError(f"struct {struct}: C type {decl!r} not understood")


def parse_struct(text: str, name: str, defines: dict[str, int]) -> list[tuple[str, str]]:
    """``[(field, ctypes expression)]`` of ``struct <name> { ... };`` in declaration order."""
    m = re.search(r"struct\s+" + name + r"\s*\{(.*?)\n\s*\};", text, re.S)
    if not m:
        raise GenerationError(f"struct {name} not found")
    body = re.sub(r"//[^\n]*", "", m.group(1))
    body = re.sub(r"/\*.*?\*/", "", body, flags=re.S)
    fields: list[tuple[str, str]] = []
    for item in (s.strip() for s in body.split(";")):
        if not item:
            continue
        fm = re.fullmatch(r"(.+?)\s*\b(\w+)\s*(?:\[([^\]]+)\])?", " ".join(item.split()))
        if not fm:
            raise GenerationError(f"struct {name}: field {item!r} not understood")
        ctype = _ctype(fm.group(1), name)
        if fm.group(3):
            ctype = f"{ctype} * {_array_size(fm.group(3), defines)}"
        fields.append((fm.group(2), ctype))
    return fields


def render(src: Path) -> str:
    ggml_dir = src / "ggml"
    defines = parse_defines((ggml_dir / "include" / "ggml.h").read_text())
    lines = [
        '"""ctypes layouts of the pinned ggml structs the host backend uses.',
        "",
        "GENERATED by scripts/gen-ggml-abi -- do not edit. Source: llama.cpp commit",
        f"{llamacpp.LLAMA_CPP_COMMIT} as vendored in llama-cpp-python=={llamacpp.LLAMA_CPP_PYTHON_VERSION}"
        " (ggml/include/ggml.h,",
        "ggml/include/ggml-cpu.h, ggml/src/ggml.c); checked against the loaded library by libggml.lib.",
        '"""',
        "",
        "from __future__ import annotations",
        "",
        "import ctypes",
        "",
    ]
    for name, value in defines.items():
        lines.append(f"{name} = {value}")
    ggml_h = (ggml_dir / "include" / "ggml.h").read_text()
    for enum in ENUMS:
        for name, value in parse_enum(ggml_h, enum).items():
            lines.append(f"{name} = {value}")
    for struct, rel, cls in STRUCTS:
        fields = parse_struct((ggml_dir / rel).read_text(), struct, defines)
        self_ref = any("POINTER(Tensor)" in c for _, c in fields)
        lines += ["", "", f"class {cls}(ctypes.Structure):", f'    """struct {struct} ({rel})."""']
        if self_ref:                               # a struct that points to itself: fields after the class
            lines += ["", "", f"{cls}._fields_ = ["]
        else:
            lines += ["", "    _fields_ = ["]
        indent = "    " if self_ref else "        "
        lines += [f"{indent}({fname!r}, {ctype})," for fname, ctype in fields]
        lines.append("]" if self_ref else "    ]")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="exit 1 if the committed file differs")
    args = ap.parse_args(argv)
    try:
        text = render(llamacpp.source_dir())
    except (GenerationError, llamacpp.LlamaCppNotBuilt) as exc:
        print(f"gen-ggml-abi: {exc}", file=sys.stderr)
        return 1
    if args.check:
        if OUTPUT.read_text() != text:
            print(f"gen-ggml-abi: {OUTPUT} is stale; run scripts/gen-ggml-abi", file=sys.stderr)
            return 1
        return 0
    OUTPUT.write_text(text)
    print(f"wrote {OUTPUT}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
