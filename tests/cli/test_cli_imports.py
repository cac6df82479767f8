"""The CLI imports a subcommand's modules only when that subcommand runs: ``rknpu probe``
loads neither matplotlib nor the benchmark, server or rknn modules (checked in a fresh
interpreter's ``sys.modules``)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

pytestmark = pytest.mark.timeout(120)

HEAVY = ("matplotlib", "ggml_rknpu.bench", "ggml_rknpu.server", "ggml_rknpu.rknn", "ggml_rknpu.engine",
         "ggml_rknpu.compiler", "gguf")


def _modules_after(argv: list[str]) -> tuple[int, set[str]]:
    code = ("import contextlib, io, json, sys\n"
            "from ggml_rknpu.cli.main import main\n"
            "try:\n"
            "    with contextlib.redirect_stdout(io.StringIO()):\n"
            f"        rc = main({argv!r})\n"
            "except SystemExit as exc:\n"
            "    rc = exc.code\n"
            "print(json.dumps([rc, sorted(sys.modules)]))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=100)
    rc, modules = json.loads(out.stdout.strip().splitlines()[-1])
    return rc, set(modules)


def _loaded(modules: set[str], prefix: str) -> bool:
    return any(m == prefix or m.startswith(prefix + ".") for m in modules)


def test_probe_imports_no_bench_server_or_plotting_modules():
    rc, modules = _modules_after(["probe", "--device", "sim-rknpu", "--json"])
    assert rc == 0 and "ggml_rknpu.cli.probe" in modules
    assert [p for p in HEAVY if _loaded(modules, p)] == []
    assert not {"ggml_rknpu.cli.bench", "ggml_rknpu.cli.serve"} & modules


def test_a_subcommand_imports_only_its_own_module():
    rc, modules = _modules_after([])
    assert rc == 2  # no subcommand: the help, and no subcommand module loaded
    assert {m for m in modules if m.startswith("ggml_rknpu.cli.")} == {"ggml_rknpu.cli.main"}
    rc, modules = _modules_after(["check-rig", "--help"])
    assert rc == 0 and {m for m in modules if m.startswith("ggml_rknpu.cli.")} == {"ggml_rknpu.cli.main",
                                                                                   "ggml_rknpu.cli.check_rig"}
