"""Which of the project's requirements install on which machine: the aarch64 guard of
scripts/test, and the account of what set-up left out on this machine (scripts/bootstrap).

``check`` resolves every requirement of pyproject.toml (the build backend, the dependencies,
every extra) for an RK3588 board, wheels only and without installing (``pip install --dry-run
--report``), against PyPI alone as a board sees it, and names each package with no wheel there.
pip judges environment markers by the interpreter running it, never by ``--platform``: the
project's own markers are judged here for the board, and the resolved set is closed over the
requirements its packages make on aarch64 only. PyPI unreachable: the check says it did not run.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import ssl
import subprocess
import sys
import time
import tomllib
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from packaging.markers import default_environment
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

PYPROJECT = Path(__file__).resolve().parents[3] / "pyproject.toml"
INDEX = "https://pypi.org/simple/"
PIP_TIMEOUT_S = 20           # per request; pip's default (15 s, 5 retries) would wait minutes offline
PROBE_TIMEOUT_S = 10
# pip settings that would add or replace indexes, wheel directories or constraints of this machine
LOCAL_PIP_SETTINGS = ("PIP_INDEX_URL", "PIP_EXTRA_INDEX_URL", "PIP_FIND_LINKS", "PIP_NO_INDEX", "PIP_CONSTRAINT",
                      "PIP_ONLY_BINARY", "PIP_NO_BINARY", "PIP_PREFER_BINARY")


@dataclass(frozen=True)
class Target:
    """A machine to install on: its glibc, CPU and Python, as pip's tags and as markers."""

    name: str
    machine: str
    glibc_minor: int          # glibc 2.<minor>
    python: str               # major.minor
    python_full: str

    def platforms(self) -> list[str]:
        """Every manylinux tag a wheel for this machine may carry (PEP 600 and the 2014 alias)."""
        return [f"manylinux_2_{m}_{self.machine}" for m in range(17, self.glibc_minor + 1)] + \
            [f"manylinux2014_{self.machine}"]

    def environment(self, extra: str = "") -> dict[str, str]:
        return {"implementation_name": "cpython", "implementation_version": self.python_full, "os_name": "posix",
                "platform_machine": self.machine, "platform_python_implementation": "CPython",
                "platform_release": "", "platform_system": "Linux", "platform_version": "",
                "python_full_version": self.python_full, "python_version": self.python, "sys_platform": "linux",
                "extra": extra}

    def describe(self) -> str:
        return f"{self.name}: {self.machine}, glibc 2.{self.glibc_minor}, CPython {self.python}"


# Debian 12 (bookworm), the root of scripts/arm64-env and the base of RK3588 board images:
# glibc 2.36, Python 3.11.2
BOARD = Target("an RK3588 board (Debian 12)", "aarch64", 36, "3.11", "3.11.2")


@dataclass(frozen=True)
class Requested:
    """One requirement of pyproject.toml and where it is declared ("build", "dependencies", "[extra]")."""

    group: str
    requirement: Requirement

    def applies(self, environment: dict[str, str]) -> bool:
        return self.requirement.marker is None or self.requirement.marker.evaluate(environment)

    def describe(self) -> str:
        r = self.requirement
        return f"{r.name}{r.specifier} ({self.group})" + (f", only where {r.marker}" if r.marker else "")


def project_requirements(pyproject: Path = PYPROJECT) -> list[Requested]:
    data = tomllib.loads(pyproject.read_text())
    project = data["project"]
    found = [Requested("build", Requirement(r)) for r in data.get("build-system", {}).get("requires", [])]
    found += [Requested("dependencies", Requirement(r)) for r in project.get("dependencies", [])]
    for extra, reqs in project.get("optional-dependencies", {}).items():
        found += [Requested(f"[{extra}]", Requirement(r)) for r in reqs]
    return found


def left_out_here(pyproject: Path = PYPROJECT) -> list[Requested]:
    """The requirements a marker keeps off this machine (nothing when there is no pyproject.toml:
    an installed package, not a checkout)."""
    if not pyproject.is_file():
        return []
    here = {k: str(v) for k, v in default_environment().items()}
    return [r for r in project_requirements(pyproject) if not r.applies({**here, "extra": ""})]


@dataclass(frozen=True)
class Resolution:
    ok: bool
    packages: list[str]        # "name version (wheel file)" of the resolved set, when ok
    missing: list[str]         # the requirements pip found no wheel for
    errors: str                # pip's ERROR lines, when not ok


def _pip_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in LOCAL_PIP_SETTINGS}
    env["PIP_CONFIG_FILE"] = os.devnull      # no config file: PyPI only, as on a board
    return env


def _pip_resolve(requirements: list[str], target: Target) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, "-m", "pip", "install", "--dry-run", "--ignore-installed", "--quiet", "--report", "-",
           "--index-url", INDEX, "--timeout", str(PIP_TIMEOUT_S), "--retries", "1", "--only-binary=:all:",
           "--implementation", "cp", "--python-version", target.python,
           "--abi", "cp" + target.python.replace(".", ""),
           *(f"--platform={p}" for p in target.platforms()), *requirements]
    return subprocess.run(cmd, env=_pip_env(), capture_output=True, text=True)


def requirements_pip_left_out(report: dict, target: Target) -> list[str]:
    """What the resolved packages require on the target that pip, judging markers on this
    machine, left out of the set."""
    have = {canonicalize_name(item["metadata"]["name"]) for item in report["install"]}
    more: dict[str, str] = {}
    for item in report["install"]:
        for extra in ["", *item.get("requested_extras", [])]:
            for line in item["metadata"].get("requires_dist", []):
                req = Requirement(line)
                name = canonicalize_name(req.name)
                if name not in have and (req.marker is None or req.marker.evaluate(target.environment(extra))):
                    req.marker = None
                    more[name] = str(req)
    return sorted(more.values())


def resolve(requirements: list[str], target: Target = BOARD) -> Resolution:
    """Resolve ``requirements`` for ``target``, wheels only; a requirement with no wheel there is
    named and taken out, and the rest resolved again, so every such requirement is named."""
    wanted = list(requirements)
    missing: list[str] = []
    errors: list[str] = []
    while True:
        proc = _pip_resolve(wanted, target)
        if proc.returncode != 0:
            failed = [ln for ln in proc.stderr.splitlines() if ln.startswith("ERROR")]
            errors += failed
            named = re.findall(r"satisfies the requirement (\S+)", "\n".join(failed))
            top = [w for w in wanted if named and canonicalize_name(Requirement(w).name) ==
                   canonicalize_name(Requirement(named[0]).name)]
            if not top:                    # a package's own requirement, or another failure
                return Resolution(False, [], missing + named, "\n".join(errors))
            missing.append(top[0])
            wanted.remove(top[0])
            continue
        report = json.loads(proc.stdout)
        more = requirements_pip_left_out(report, target)
        if not more:
            packages = [f"{i['metadata']['name']} {i['metadata']['version']} "
                        f"({i['download_info']['url'].rsplit('/', 1)[-1]})" for i in report["install"]]
            return Resolution(not missing, packages, missing, "\n".join(errors))
        wanted += more


def pypi_unreachable() -> str | None:
    """Why PyPI cannot be reached from here, or None when it can."""
    cafile = os.environ.get("PIP_CERT") or os.environ.get("SSL_CERT_FILE")
    context = ssl.create_default_context(cafile=cafile)
    try:
        with urllib.request.urlopen(INDEX + "pip/", timeout=PROBE_TIMEOUT_S, context=context):
            return None
    except (urllib.error.URLError, OSError) as exc:
        return f"{INDEX} unreachable ({getattr(exc, 'reason', exc)})"


def check(pyproject: Path = PYPROJECT, target: Target = BOARD, *, verbose: bool = False) -> int:
    """Print the verdict (and with ``verbose`` every resolved wheel); 0 when every requirement that
    applies on ``target`` has a wheel there (or PyPI cannot be reached: said so), 1 naming each one
    that has none."""
    start = time.monotonic()
    requested = project_requirements(pyproject)
    applies = [r for r in requested if r.applies(target.environment())]
    skipped = [r.describe() for r in requested if r not in applies]
    me = "platform wheels"
    if (why := pypi_unreachable()) is not None:
        print(f"{me}: NOT CHECKED for {target.describe()}: {why}", file=sys.stderr)
        return 0
    res = resolve([str(r.requirement) for r in applies], target)
    took = time.monotonic() - start
    if not res.ok:
        by_name = {canonicalize_name(r.requirement.name): r.describe() for r in applies}
        named = [by_name.get(canonicalize_name(Requirement(m).name), f"{m} (required by a dependency)")
                 for m in res.missing] or ["(see pip's errors)"]
        print(f"{me}: FAILED for {target.describe()}: no wheel for {'; '.join(named)}", file=sys.stderr)
        if res.errors:
            print("\n".join("    " + ln for ln in res.errors.splitlines()), file=sys.stderr)
        print(f"{me}: give such a requirement a marker (pyproject.toml) or a replacement that has one", file=sys.stderr)
        return 1
    print(f"{me}: {len(res.packages)} packages resolve to wheels for {target.describe()} ({took:.1f} s); "
          f"left out there by their markers: {'; '.join(skipped) or 'none'}", file=sys.stderr)
    if verbose:
        print("\n".join("    " + p for p in res.packages), file=sys.stderr)
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m ggml_rknpu.toolchain.platform_wheels", description=__doc__)
    p.add_argument("what", nargs="?", default="check", choices=("check", "left-out"),
                   help="check: the aarch64 guard (default); left-out: what a marker keeps off this machine")
    p.add_argument("--pyproject", type=Path, default=PYPROJECT)
    p.add_argument("-v", "--verbose", action="store_true", help="check: list the resolved wheels")
    args = p.parse_args(argv)
    if args.what == "left-out":
        for r in left_out_here(args.pyproject):
            print(r.describe())
        return 0
    return check(args.pyproject, verbose=args.verbose)


if __name__ == "__main__":
    sys.exit(main())
