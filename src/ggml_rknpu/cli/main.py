"""``rknpu``: one entry point, one module per subcommand.

Each subcommand lives in ``ggml_rknpu.cli.<module>`` and exposes
``add_arguments(parser)`` and ``run(args) -> int`` (the exit code). Only the module of
the subcommand that runs is imported, so ``rknpu probe`` never pays for the server's or
the benchmarks' imports (a test checks ``sys.modules``).
"""

from __future__ import annotations

import argparse
import importlib
import sys

from ggml_rknpu import __version__

# subcommand -> (module, one-line help)
SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "probe": ("ggml_rknpu.cli.probe", "open the NPU, print driver/hardware facts, do a buffer round trip"),
    "serve": ("ggml_rknpu.cli.serve", "run the ggml RPC server llama.cpp connects to with --rpc"),
    "demo": ("ggml_rknpu.cli.demo", "build what is needed, serve on the NPU (or simulator), generate text"),
    "check-rig": ("ggml_rknpu.cli.check_rig", "check DRAM/CPU/NPU clocks, governors, thermals before benchmarking"),
    "bench": ("ggml_rknpu.cli.bench", "benchmarks: matmul, sustained, model, decode, prefill, rpc-overhead, rpc8-decode, host-placement, host-batches, "
                                       "calibrate-placement, fit, memory, soak, concurrent, spec, npu-submit, sim"),
    "selftest": ("ggml_rknpu.cli.selftest", "validate this project on the board (or simulator) and write an archive"),
}


def build_parser(argv: list[str] | None = None) -> argparse.ArgumentParser:
    """The parser for ``argv``: every subcommand is listed, but only the one ``argv`` names
    is imported (for its arguments, docstring and ``run``)."""
    chosen = next((a for a in (sys.argv[1:] if argv is None else argv) if not a.startswith("-")), None)
    parser = argparse.ArgumentParser(
        prog="rknpu",
        description="The RK3588 NPU as a compute device for llama.cpp (simulator when no NPU is present).",
    )
    parser.add_argument("--version", action="version", version=f"ggml-rknpu {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (module_name, help_text) in SUBCOMMANDS.items():
        if name != chosen:
            sub.add_parser(name, help=help_text)
            continue
        module = importlib.import_module(module_name)
        p = sub.add_parser(name, help=help_text, description=module.__doc__)
        module.add_arguments(p)
        p.set_defaults(subcommand_run=module.run)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser(argv)
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 2
    return int(args.subcommand_run(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
