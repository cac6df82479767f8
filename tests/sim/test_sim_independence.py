"""The simulator is an independent witness: it must never import ggml_rknpu.compiler
(docs/architecture.md rule 4). Checked statically (every import in sim/*.py) and at runtime
(importing the NPU model leaves the compiler unloaded)."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import ggml_rknpu.sim

SIM_DIR = Path(ggml_rknpu.sim.__file__).parent


def _imported_modules(path: Path) -> list[str]:
    names = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            names += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:   # resolve relative imports against ggml_rknpu.sim
                parent = ["ggml_rknpu", "sim"][: 2 - (node.level - 1)]
                base = ".".join(parent + ([base] if base else []))
            names += [base] + [f"{base}.{a.name}" for a in node.names]
    return names


def test_no_sim_module_imports_the_compiler():
    files = sorted(SIM_DIR.glob("*.py"))
    assert {"npu.py", "pc.py", "conv.py", "validate.py"} <= {f.name for f in files}
    offenders = {f.name: m for f in files for m in _imported_modules(f)
                 if m == "ggml_rknpu.compiler" or m.startswith("ggml_rknpu.compiler.")}
    assert offenders == {}


def test_the_scan_sees_relative_and_absolute_forms(tmp_path):
    probe = tmp_path / "probe.py"
    probe.write_text("from ..compiler import matmul\nimport ggml_rknpu.compiler.layout\n")
    found = _imported_modules(probe)
    assert "ggml_rknpu.compiler" in found and "ggml_rknpu.compiler.layout" in found


def test_importing_the_npu_model_does_not_load_the_compiler():
    code = ("import sys, ggml_rknpu.sim.npu, ggml_rknpu.sim.kernel; "
            "print(sorted(m for m in sys.modules if m.startswith('ggml_rknpu.compiler')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout
