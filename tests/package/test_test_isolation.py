"""Each test module runs alone: no test module imports another ``test_*`` module (pytest
puts a test's own folder on ``sys.path``, so such an import works only when the other
folder happened to be collected first). Shared helpers live in ``tests/support``."""

from __future__ import annotations

import ast
import json
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]


def _imported_modules(path: Path) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names.add(node.module)
    return names


def test_no_test_module_imports_another_test_module():
    offenders = {
        str(path.relative_to(TESTS)): sorted(m for m in _imported_modules(path)
                                             if m.rsplit(".", 1)[-1].startswith("test_"))
        for path in sorted(TESTS.rglob("*.py"))
    }
    assert {p: m for p, m in offenders.items() if m} == {}


def test_the_check_sees_an_import_of_a_test_module(tmp_path):
    probe = tmp_path / "test_probe.py"
    probe.write_text("def f():\n    from test_bench_matmul import RIGS\n    import tests.server.test_rpc_graph\n")
    assert {"test_bench_matmul", "tests.server.test_rpc_graph"} <= _imported_modules(probe)


def test_the_session_has_a_home_of_its_own_and_subprocesses_inherit_it():
    """tests/conftest.py moves HOME, the XDG directories and the envelope record out of the
    user's home for the whole session (engines opened by module fixtures included), and
    keeps the client builds' cache where the build scripts put it."""
    import os
    import pwd
    import subprocess
    import sys

    user_home = Path(pwd.getpwuid(os.getuid()).pw_dir).resolve()
    probe = ("import json, os; from pathlib import Path; "
             "from ggml_rknpu.engine.envelope_record import record_path; "
             "from ggml_rknpu.toolchain.llamacpp import cache_dir; "
             "print(json.dumps([str(Path.home()), os.environ['XDG_CONFIG_HOME'], os.environ['XDG_CACHE_HOME'], "
             "str(record_path()), str(cache_dir())]))")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True, timeout=60)
    home, config, cache, record, builds = (Path(p).resolve() for p in json.loads(out.stdout))
    assert home != user_home and not home.is_relative_to(user_home)
    assert config.is_relative_to(home) and cache.is_relative_to(home)
    assert not record.is_relative_to(user_home)
    assert str(builds) == os.environ["RKNPU_CACHE"]
