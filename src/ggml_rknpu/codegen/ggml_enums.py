"""Generator of ``ggml_rknpu/libggml/enums.py`` from the pinned llama.cpp (run ``scripts/gen-ggml-enums``).

Op, type, unary and glu numbers are the build's enum order and change between llama.cpp
versions (docs/ggml-rpc.md P3), so they are never hand-copied. Invariant: every value is
cross-checked between two sources, so a parsing slip cannot pass silently: enum values
parsed from ``ggml.h`` against the built ``libggml-base.so``'s names; block and type sizes
from the library against ``gguf``'s ``GGML_QUANT_SIZES``; the RPC protocol version from the
``RPC_PROTO_*_VERSION`` defines of ``ggml-rpc.h``."""

from __future__ import annotations

import argparse
import ctypes
import difflib
import re
import sys
from pathlib import Path

from ggml_rknpu.toolchain import llamacpp

OUTPUT = Path(__file__).resolve().parent.parent / "libggml" / "enums.py"

# C enum name -> (Python class, member prefix, count member or None, ctypes name function or None)
_ENUMS = (
    ("ggml_type", "GgmlType", "GGML_TYPE_", "GGML_TYPE_COUNT", None),
    ("ggml_op", "GgmlOp", "GGML_OP_", "GGML_OP_COUNT", "ggml_op_name"),
    ("ggml_unary_op", "GgmlUnaryOp", "GGML_UNARY_OP_", "GGML_UNARY_OP_COUNT", "ggml_unary_op_name"),
    ("ggml_glu_op", "GgmlGluOp", "GGML_GLU_OP_", "GGML_GLU_OP_COUNT", "ggml_glu_op_name"),
    # rpc_tensor.flags: COMPUTE marks the nodes a backend must run (ggml_build_forward_select)
    ("ggml_tensor_flag", "GgmlTensorFlag", "GGML_TENSOR_FLAG_", None, None),
)


# gguf entries known to lag the pinned ggml; the build is authoritative for these.
# [ggml-common.h: static_assert(sizeof(block_q8_1) == 2*sizeof(ggml_half) + QK8_1)] = 36 B,
# gguf 0.19 still lists the old float d/s block (40 B). Q8_1 is a runtime-only type.
_GGUF_STALE = frozenset({"Q8_1"})


class GenerationError(RuntimeError):
    """The headers and the built library disagree, or a header could not be parsed."""


def parse_enum(header_text: str, enum_name: str) -> dict[str, int]:
    """Members of ``enum <enum_name> { ... }`` with their values (C numbering rules)."""
    match = re.search(r"enum\s+" + re.escape(enum_name) + r"\s*\{(.*?)\};", header_text, re.S)
    if not match:
        raise GenerationError(f"enum {enum_name} not found in ggml.h")
    body = re.sub(r"//[^\n]*", "", match.group(1))
    body = re.sub(r"/\*.*?\*/", "", body, flags=re.S)
    members: dict[str, int] = {}
    next_value = 0
    for item in (part.strip() for part in body.split(",")):
        if not item:
            continue
        name, _, value = (s.strip() for s in item.partition("="))
        if not re.fullmatch(r"[A-Z_][A-Z0-9_]*", name):
            raise GenerationError(f"cannot parse enum {enum_name} member {item!r}")
        if value:
            shift = re.fullmatch(r"\(\s*1\s*<<\s*(\d+)\s*\)", value)      # flag enums: (1 << n)
            if shift:
                next_value = 1 << int(shift.group(1))
            elif re.fullmatch(r"\d+", value):
                next_value = int(value)
            else:
                raise GenerationError(f"enum {enum_name}: non-literal value {item!r}")
        members[name] = next_value
        next_value += 1
    return members


def parse_rpc_proto(rpc_header_text: str) -> tuple[int, int, int]:
    parts = []
    for level in ("MAJOR", "MINOR", "PATCH"):
        match = re.search(rf"#define\s+RPC_PROTO_{level}_VERSION\s+(\d+)", rpc_header_text)
        if not match:
            raise GenerationError(f"RPC_PROTO_{level}_VERSION not found in ggml-rpc.h")
        parts.append(int(match.group(1)))
    return (parts[0], parts[1], parts[2])


def _load_library(path: Path) -> ctypes.CDLL:
    lib = ctypes.CDLL(str(path))
    for fn in ("ggml_op_name", "ggml_unary_op_name", "ggml_glu_op_name", "ggml_type_name"):
        getattr(lib, fn).restype = ctypes.c_char_p
        getattr(lib, fn).argtypes = [ctypes.c_int]
    lib.ggml_blck_size.restype = ctypes.c_int64
    lib.ggml_blck_size.argtypes = [ctypes.c_int]
    lib.ggml_type_size.restype = ctypes.c_size_t
    lib.ggml_type_size.argtypes = [ctypes.c_int]
    return lib


def _check_names(lib: ctypes.CDLL, fn: str, prefix: str, members: dict[str, int]) -> None:
    name_of = getattr(lib, fn)
    for name, value in members.items():
        if name.endswith("_COUNT"):
            continue
        got = name_of(value).decode()
        if got != name[len(prefix):]:
            raise GenerationError(f"{fn}({value}) = {got!r} but ggml.h says {name}")


def _type_traits(lib: ctypes.CDLL, types: dict[str, int]) -> dict[str, tuple[int, int, str]]:
    """name -> (block_size, type_size, ggml type name) for every live type, cross-checked with gguf."""
    from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

    gguf_sizes = {t.value: size for t, size in GGML_QUANT_SIZES.items()}
    gguf_names = {t.value: t.name for t in GGMLQuantizationType}
    traits: dict[str, tuple[int, int, str]] = {}
    for name, value in types.items():
        if name.endswith("_COUNT"):
            continue
        block, size = int(lib.ggml_blck_size(value)), int(lib.ggml_type_size(value))
        if block <= 0 or size <= 0:
            raise GenerationError(f"{name} ({value}) has no size in libggml-base")
        short = name[len("GGML_TYPE_"):]
        if value in gguf_sizes and short not in _GGUF_STALE:
            if gguf_sizes[value] != (block, size) or gguf_names[value] != short:
                raise GenerationError(f"{name}: ggml says {(block, size)}, gguf says "
                                      f"{gguf_names[value]} {gguf_sizes[value]}")
        traits[name] = (block, size, lib.ggml_type_name(value).decode())
    return traits


def generate(source: Path | None = None, library: Path | None = None) -> str:
    """The text of ``enums.py`` for the pinned tree (``source``) and its build (``library``)."""
    source = source or llamacpp.source_dir()
    library = library or llamacpp.base_library()
    ggml_h = (source / "ggml" / "include" / "ggml.h").read_text()
    rpc_h = (source / "ggml" / "include" / "ggml-rpc.h").read_text()
    lib = _load_library(library)

    lines = [
        '"""ggml enums, type traits and the RPC protocol version of the pinned llama.cpp.',
        "",
        "GENERATED by scripts/gen-ggml-enums -- do not edit. Source: llama.cpp commit",
        f"{llamacpp.LLAMA_CPP_COMMIT} as vendored in llama-cpp-python=={llamacpp.LLAMA_CPP_PYTHON_VERSION} "
        "(ggml/include/ggml.h,",
        "ggml/include/ggml-rpc.h; sizes from the built libggml-base, cross-checked with gguf).",
        '"""',
        "",
        "from __future__ import annotations",
        "",
        "from enum import IntEnum",
        "",
        f"LLAMA_CPP_COMMIT = {llamacpp.LLAMA_CPP_COMMIT!r}",
        f"RPC_PROTO = {parse_rpc_proto(rpc_h)!r}",
    ]
    all_members: dict[str, dict[str, int]] = {}
    for c_name, py_name, prefix, count_name, name_fn in _ENUMS:
        members = parse_enum(ggml_h, c_name)
        if count_name is not None and count_name not in members:
            raise GenerationError(f"{count_name} missing from enum {c_name}")
        if name_fn:
            _check_names(lib, name_fn, prefix, members)
        all_members[py_name] = members
        if count_name is not None:
            lines.append(f"{count_name} = {members[count_name]}")
    for c_name, py_name, prefix, count_name, _ in _ENUMS:
        lines += ["", "", f"class {py_name}(IntEnum):", f'    """enum {c_name} (ggml.h)."""', ""]
        for name, value in all_members[py_name].items():
            if name != count_name:
                lines.append(f"    {name[len(prefix):]} = {value}")

    traits = _type_traits(lib, all_members["GgmlType"])
    lines += ["", "", "# (block_size, type_size in bytes) per type: ggml_blck_size / ggml_type_size",
              "TYPE_TRAITS: dict[GgmlType, tuple[int, int]] = {"]
    for name, (block, size, _) in traits.items():
        lines.append(f"    GgmlType.{name[len('GGML_TYPE_'):]}: ({block}, {size}),")
    lines += ["}", "", "# ggml_type_name (the spelling test-backend-ops uses, e.g. 'q4_K')",
              "TYPE_NAMES: dict[GgmlType, str] = {"]
    for name, (_, _, type_name) in traits.items():
        lines.append(f"    GgmlType.{name[len('GGML_TYPE_'):]}: {type_name!r},")
    lines.append("}")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="exit 1 if enums.py is not up to date")
    parser.add_argument("--output", type=Path, default=OUTPUT)
    parser.add_argument("--client", help="with --check: another client build (scripts/build-llama-cpp) whose "
                        "enums and RPC protocol must equal the committed ones")
    parser.add_argument("--source", type=Path, help="llama.cpp source tree (default: the pinned one)")
    parser.add_argument("--library", type=Path, help="its built libggml-base.so (default: the pinned one)")
    args = parser.parse_args(argv)
    try:
        text = generate(args.source, args.library)
    except (llamacpp.LlamaCppNotBuilt, GenerationError, OSError) as exc:
        print(f"gen-ggml-enums: {exc}", file=sys.stderr)
        return 1
    if args.check:
        current = args.output.read_text() if args.output.exists() else ""
        if current == text:
            return 0
        if args.client:
            diff = difflib.unified_diff(current.splitlines(), text.splitlines(), "server (enums.py)",
                                        f"client {args.client}", lineterm="", n=0)
            print(f"gen-ggml-enums: client {args.client} ({args.source}) has other ggml enums or RPC protocol "
                  f"than the server:\n" + "\n".join(list(diff)[:40]), file=sys.stderr)
        else:
            print(f"gen-ggml-enums: {args.output} is out of date; run scripts/gen-ggml-enums", file=sys.stderr)
        return 1
    args.output.write_text(text)
    print(f"wrote {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
