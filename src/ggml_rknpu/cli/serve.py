"""Serve the NPU (or its simulator) to unmodified llama.cpp over the ggml RPC protocol 7.0.0 or 8.0.0.

  rknpu serve --port 50052 --device sim-rknpu
  llama-completion -m model.gguf --rpc 127.0.0.1:50052 -ngl 99 ...

Flags follow ggml-rpc-server (-H/--host, -p/--port, -t/--threads, -c/--cache); ``--protocol``:
docs/server.md "Choosing the protocol".
``--device host`` runs every op on the host (no NPU engine): a protocol and op
reference. ``--engine rknn`` runs the matmuls through Rockchip's closed librknnrt instead
of our own register commands, chosen once at start-up (the device rule is in
``rknn.opener``: a vendor rknpu node, or an explicit ``$LIBRKNNRT_PATH``). Counters (where
ops ran, staged weights, host µs per node, the engine's own): SIGUSR1, ``--stats``, exit.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
from pathlib import Path
from typing import Any

from ggml_rknpu.server.host_budget import HostBudget, default_budget, fix_malloc_threshold, mem_total_bytes
from ggml_rknpu.server.rpc.deadlines import MIN_RATE_KIB_S

DEVICES = ("auto", "rknpu", "rocket", "sim-rknpu", "sim-rocket", "host")
ENGINES = ("ours", "rknn")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("-H", "--host", default="127.0.0.1",
                   help="address to bind (default 127.0.0.1; anything else is reachable without authentication)")
    p.add_argument("-p", "--port", type=int, default=50052, help="TCP port (default 50052, 0 = any free port)")
    p.add_argument("--protocol", default="7", choices=("7", "8", "auto"),
                   help="ggml RPC protocol major: 7 (default: the pinned llama.cpp, b11434), 8 (llama.cpp b11458 and "
                        "later), auto (7 on --port and 8 on --port + 1)")
    p.add_argument("--device", default="auto", choices=DEVICES,
                   help="NPU to serve: real driver, simulator, or 'host' (no NPU, all ops in numpy); "
                        "auto = real NPU if present else sim-rknpu (env RKNPU_DEVICE overrides)")
    p.add_argument("--envelope", default="recorded", choices=("recorded", "proven", "extended"),
                   help="what the compiler may emit: recorded (default: the proven envelope widened by what "
                        "this board's `rknpu selftest` ladder passed), proven, or extended (unproven on "
                        "silicon: at your board's risk)")
    p.add_argument("--engine", default="ours", choices=ENGINES,
                   help="matmul engine: ours (our register commands) or rknn (Rockchip's closed librknnrt, "
                        "installed by you; found at $LIBRKNNRT_PATH or the usual library directories)")
    p.add_argument("--rknn-contexts", type=int, default=32, metavar="N",
                   help="--engine rknn: at most N live librknnrt contexts, least recently used evicted "
                        "(default 32; the runtime failed beyond ~150 in the seed's tests)")
    p.add_argument("--weights", default="fp16", choices=("fp16", "int8"),
                   help="format weights are staged in on the NPU (fp16 is the accuracy reference)")
    p.add_argument("-c", "--cache", type=Path, default=None, metavar="DIR",
                   help="tensor cache directory for SET_TENSOR_HASH (like ggml-rpc-server -c)")
    p.add_argument("-t", "--threads", type=int, default=None,
                   help="host threads: ggml-cpu's threadpool for the host ops and the BLAS pool (default: "
                        "the cores but one, at most 4 -- the four Cortex-A76 of an RK3588, 1 on a 2-core box)")
    p.add_argument("--stats", action="store_true",
                   help="print the placement counters after every client that ran graphs")
    p.add_argument("--stats-json", type=Path, default=None, metavar="FILE",
                   help="also write the counters as JSON to FILE after every computing client and at exit")
    p.add_argument("--stall-timeout", type=float, default=120.0, metavar="SECONDS",
                   help="drop a client that sends (or reads) nothing this long in the middle of a message or "
                        "a reply; a message header must also arrive within it of its first byte")
    p.add_argument("--min-rate", type=float, default=MIN_RATE_KIB_S, metavar="KIB",
                   help=f"drop a client whose message (or reply) of N bytes is not complete within "
                        f"stall-timeout + N / (KIB KiB/s) of its first byte, though bytes keep coming "
                        f"(default {MIN_RATE_KIB_S:g}: about 0.5 Mbit/s; a 300 MB tensor gets 78 min)")
    p.add_argument("--idle-timeout", type=float, default=None, metavar="SECONDS",
                   help="drop a client idle this long between messages (default: never; llama-server holds "
                        "its connection idle for hours between requests)")
    p.add_argument("--max-clients", type=int, default=None, metavar="N",
                   help="connections served at once, each by its own thread (default 256); one more is refused "
                        "at accept, with a log line")
    p.add_argument("--session-memory", type=int, default=None, metavar="MIB",
                   help="buffers one connection may hold, in MiB (default: the whole device budget); an "
                        "ALLOC_BUFFER beyond it is refused with a logged reason, as when the device is full")
    p.add_argument("--no-weight-reuse", action="store_true",
                   help="free a client's staged weights when it leaves instead of keeping them (keyed by "
                        "content) for the next client; see docs/server.md")
    p.add_argument("--no-fuse", action="store_true",
                   help="one NPU submit per matmul: do not chain the matmuls that read one activation "
                        "(Q/K/V, gate/up) into one submit (for comparison; the results are the same)")
    p.add_argument("--activations", choices=("fp16", "ggml"), default="fp16",
                   help="what NPU matmuls multiply: fp16 (default) converts the f32 activations to fp16 as "
                        "they are; ggml first rounds them as ggml-cpu does for the weight's type (Q8_K for "
                        "the k-quants, Q8_0/Q8_1 for the legacy quants), so each matmul is ~50x closer to "
                        "ggml-cpu's, the model as a whole not (docs/server.md 'Activation numerics')")
    p.add_argument("--npu-memory", type=int, default=None, metavar="MIB",
                   help="stage at most MIB MiB in NPU memory (weights, programs, scratch); weights beyond it run "
                        "on the host from their ggml bytes (boards share DRAM between CPU and NPU)")
    p.add_argument("--host-cache-budget", type=int, default=None, metavar="MIB",
                   help="memory kept for reuse that no client holds: staged weights of freed buffers (all of it; "
                        "a quarter on the simulator), bound programs (a quarter); default from the machine's "
                        "memory, MemTotal / 16 within 128 MiB .. 1 GiB (docs/memory.md)")
    p.add_argument("--memory-budget", type=int, default=None, metavar="MIB",
                   help="board memory the server may hold (its buffers, copies, NPU memory, plans, itself); each "
                        "weight keeps host, NPU or both copies for the fastest modeled job that fits (NPU only: no "
                        "repacked copy; host only: no NPU copy), never a refused model (default: MemAvailable at "
                        "start-up less a reserve of MemTotal / 8, at least 512 MiB); docs/memory.md")
    p.add_argument("--weight-pages", type=Path, default=None, metavar="DIR",
                   help="where the GGUF bytes of weights with a repacked or NPU copy are paged (an unlinked file on "
                        "disk per buffer, which the kernel may drop and read again; default "
                        "~/.cache/ggml-rknpu/weight-pages; never tmpfs); docs/memory.md")
    p.add_argument("--no-weight-pages", action="store_true",
                   help="keep every uploaded byte in anonymous memory (two host copies of a repacked weight)")
    p.add_argument("--placement", default="auto", choices=("auto", "npu", "host"),
                   help="where weight matmuls run: auto (default: each weight and M bucket where the board's cost "
                        "models say it is faster), npu (every eligible weight on the NPU), host (every weight matmul "
                        "in ggml-cpu from its GGUF bytes; no NPU memory); docs/placement.md")
    p.add_argument("--host-threads", type=int, default=None, metavar="N",
                   help="A76 threads the CPU model prices host matmuls at (default: --threads when given, else the "
                        "board's 4 big cores; at most 4)")
    p.add_argument("--no-host-repack", action="store_true",
                   help="host weight matmuls run from the GGUF bytes as uploaded, not from a copy in ggml-cpu's "
                        "repacked layout (CPU_REPACK, what llama.cpp alone runs; the default where ggml repacks the "
                        "type); docs/placement.md")
    p.add_argument("--placement-split", action="store_true",
                   help="opt-in: with --placement auto, a weight matmul the board models price fastest split runs "
                        "its first rows on the NPU and the rest in ggml-cpu at once (modeled gain only; "
                        "docs/placement.md)")
    p.add_argument("--npu-attention", default="auto", choices=("auto", "on", "off"),
                   help="attention's matmuls (QK^T, PV) on the NPU: where the board's models say it is faster "
                        "(auto, the default: prefill, long verifies; never decode rows), for every f16 KV-cache "
                        "pass (on), or never (off); docs/placement.md")
    p.add_argument("--sim-faults", default=None, metavar="SPEC",
                   help="simulator only: inject NPU faults per submit, e.g. 'timeout:0.02,dma:0.01,stale:0.02,"
                        "core:0.01,seed=1' (rates) or 'stale@5,core@9' (submit numbers); see sim/faults.py")
    p.add_argument("--no-progress", action="store_true", help="no progress bar while weights are staged")
    p.add_argument("-v", "--verbose", action="store_true", help="debug logging (every connection)")


def _set_threads(threads: int | None) -> None:
    """BLAS pools read their size at load; re-exec once if numpy is already loaded with another size."""
    if threads is None:
        return
    wanted = str(threads)
    names = ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS")
    if all(os.environ.get(n) == wanted for n in names):
        return
    for n in names:
        os.environ[n] = wanted
    if "numpy" in sys.modules:
        os.execv(sys.executable, [sys.executable, "-m", "ggml_rknpu.cli.main", *sys.argv[1:]])


def _open_engine(args: argparse.Namespace):
    """(engine or None for --device host, how to name it in the start-up line, the
    ``FaultInjector`` under --sim-faults or None)."""
    if args.engine == "rknn":
        from ggml_rknpu.rknn.opener import open_rknn

        npu, setup = open_rknn(args.device, max_contexts=args.rknn_contexts)
        return npu, f"{setup.describe()}, at most {args.rknn_contexts} contexts", None
    if args.device == "host":
        return None, "host only (no NPU)", None
    import ggml_rknpu

    device, injector = _faulty_device(args) if args.sim_faults is not None else (None, None)
    try:
        npu = ggml_rknpu.open(device=device or (None if args.device == "auto" else args.device),
                              envelope=None if args.envelope == "recorded" else args.envelope)
    except BaseException:
        if device is not None:
            device.close()
        raise
    described = (f"NPU engine on {npu.describe()}, envelope {npu.envelope.describe()} "
                 "(run `rknpu selftest` to widen it)")
    if injector is not None:
        described += f", injected faults: {injector.spec.describe()}"
    return npu, described, injector


def _host_budget(args: argparse.Namespace, npu: Any) -> HostBudget:
    """The host cache budget, applied to the engine's programs and, on the simulator, to its
    decoded weights (the retired weights get theirs through ``ServerConfig``)."""
    if not fix_malloc_threshold():
        logging.getLogger("ggml_rknpu.rpc").info("not glibc: the C library's mmap threshold is left as it is "
                                                 "(docs/memory.md)")
    sim: Any = getattr(getattr(npu, "device", None), "syscalls", None)
    host_budget = HostBudget(args.host_cache_budget << 20 if args.host_cache_budget is not None
                             else default_budget(mem_total_bytes()), simulated=hasattr(sim, "limit_decode_cache"))
    if hasattr(npu, "program_budget"):
        npu.program_budget = host_budget.share("programs")
    if host_budget.simulated:
        sim.limit_decode_cache(host_budget.share("sim_decoded"))
    return host_budget


def _faulty_device(args: argparse.Namespace):
    """(the simulated device behind a ``sim.faults.FaultInjector``, that injector); refused
    on a board."""
    from ggml_rknpu.devices import open_device
    from ggml_rknpu.sim.faults import FaultSpec, inject_faults

    spec = FaultSpec.parse(args.sim_faults)
    kind = args.device.removeprefix("sim-")
    if args.device == "auto":
        with open_device(None) as probe:
            if not probe.simulated:
                raise ValueError(f"--sim-faults injects faults into the NPU simulator only and --device auto found "
                                 f"a real NPU ({probe.kind} at {probe.path}); refused (use --device sim-rknpu)")
            kind = probe.kind
    elif not args.device.startswith("sim-"):
        raise ValueError(f"--sim-faults injects faults into the NPU simulator only; refused on a real device "
                         f"(--device {args.device}); use --device sim-rknpu or sim-rocket")
    injector = inject_faults(kind, spec)
    return open_device(f"sim-{kind}", syscalls=injector), injector


def _ensure_host_libraries() -> None:
    """First run on a server-only machine: build libggml-base/libggml-cpu (scripts/build-ggml)
    when no build has them; a failed build surfaces as the usual missing-library error."""
    import subprocess

    from ggml_rknpu.libggml.lib import GgmlLibraryMissing
    from ggml_rknpu.toolchain import llamacpp
    from ggml_rknpu.toolchain.launch import ensure_ggml_built

    try:
        ensure_ggml_built()
    except llamacpp.LlamaCppNotBuilt as exc:
        raise GgmlLibraryMissing(str(exc)) from None
    except subprocess.CalledProcessError as exc:
        raise GgmlLibraryMissing(f"scripts/build-ggml failed (exit {exc.returncode}; its output is above)") from None


def _activations_text(args: argparse.Namespace) -> str:
    if args.device == "host":
        return "n/a (no NPU)"
    return "rounded to ggml-cpu's vec_dot types" if args.activations == "ggml" else "fp16"


def _listening_text(server, host: str) -> str:
    """``ggml RPC 7.0.0 on host:port`` for each major the server answers, and on which port."""
    from ggml_rknpu.server.rpc.wire import version_text

    return " and ".join(f"ggml RPC {version_text(m)} on {host}:{p}" for m, p in sorted(server.ports.items()))


def run(args: argparse.Namespace) -> int:
    _set_threads(args.threads)
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO,
                        format="%(asctime)s %(levelname)s %(message)s", stream=sys.stderr)
    log = logging.getLogger("ggml_rknpu.rpc")

    from ggml_rknpu.server.buffers import DeviceBudget
    from ggml_rknpu.server.memory_budget import for_server
    from ggml_rknpu.server.rpc import report
    from ggml_rknpu.server.rpc.config import HOST_ONLY_BUDGET, MAX_CLIENTS, ServerConfig
    from ggml_rknpu.server.rpc.listener import RpcServer
    from ggml_rknpu.server.rpc.state import ServerState
    from ggml_rknpu.server.weight_pages import WeightPages, default_directory

    if args.memory_budget is not None and args.memory_budget < 1:
        log.error("--memory-budget must be a positive MiB figure, got %d", args.memory_budget)
        return 2
    if args.rknn_contexts < 1:
        log.error("--rknn-contexts must be at least 1, got %d", args.rknn_contexts)
        return 2
    if args.sim_faults is not None and (args.engine == "rknn" or args.device == "host"):
        log.error("--sim-faults needs our engine on the NPU simulator (not --engine rknn or --device host)")
        return 2
    if args.engine == "rknn" and args.device == "host":
        log.error("--engine rknn and --device host contradict each other (host runs no engine)")
        return 2
    if not args.min_rate > 0 or not args.stall_timeout > 0:
        log.error("--min-rate and --stall-timeout must be above 0, got %g KiB/s and %g s", args.min_rate,
                  args.stall_timeout)
        return 2
    try:
        npu, engine, injector = _open_engine(args)
    except Exception as exc:
        log.error("cannot open the %s engine for --device %s: %s (use --device host to serve without it)",
                  args.engine, args.device, exc)
        return 1
    if args.npu_memory is not None:
        if args.npu_memory < 1 or npu is None or not hasattr(npu, "memory_cap"):
            log.error("--npu-memory needs a positive MiB figure and our engine on an NPU (not --device host or "
                      "--engine rknn)")
            if npu is not None:
                npu.close()
            return 2
        npu.memory_cap = args.npu_memory << 20
        engine += f", NPU memory capped at {args.npu_memory} MiB"
    placement = args.placement
    if args.engine == "rknn" and placement == "auto":
        # the cost models price our own driver path, not librknnrt's per-call cost (docs/placement.md)
        placement = "npu"
        log.info("--engine rknn: --placement auto has no cost model of librknnrt, so every eligible matmul "
                 "runs on the NPU (--placement host runs them in ggml-cpu)")
    try:
        host_budget = _host_budget(args, npu)
    except ValueError as exc:
        log.error("--host-cache-budget: %s", exc)
        if npu is not None:
            npu.close()
        return 2
    engine += f", {host_budget.describe()}"
    budget = npu.memory_budget if npu is not None else (lambda: (HOST_ONLY_BUDGET, HOST_ONLY_BUDGET))
    try:
        pages = None if args.no_weight_pages else WeightPages(args.weight_pages or default_directory())
    except (OSError, ValueError) as exc:
        log.error("--weight-pages: %s", exc)
        if npu is not None:
            npu.close()
        return 2
    config = ServerConfig(weight_format=args.weights, cache_dir=args.cache, progress=not args.no_progress,
                          stats_each_client=args.stats, stats_json=args.stats_json,
                          stall_timeout_s=args.stall_timeout, min_rate_kib_s=args.min_rate,
                          weight_reuse=not args.no_weight_reuse,
                          threads=args.threads, group_matmuls=not args.no_fuse,
                          activations=args.activations, placement=placement,
                          host_threads=args.host_threads, host_repack=not args.no_host_repack,
                          placement_split=args.placement_split, npu_attention=args.npu_attention,
                          idle_timeout_s=args.idle_timeout,
                          max_clients=args.max_clients or MAX_CLIENTS,
                          session_memory=None if args.session_memory is None else args.session_memory << 20,
                          retired_budget=host_budget.share("retired_weights"))
    from ggml_rknpu.libggml.lib import GgmlAbiError, GgmlLibraryMissing

    if args.threads is not None and args.threads < 1:
        log.error("--threads must be at least 1, got %d", args.threads)
        return 2
    if args.host_threads is not None and not 1 <= args.host_threads <= 4:
        log.error("--host-threads must be 1..4 (the board's A76 cores), got %d", args.host_threads)
        if npu is not None:
            npu.close()
        return 2
    try:
        _ensure_host_libraries()
        state = ServerState(npu=npu, memory=DeviceBudget(budget, pages), config=config, faults=injector)
    except (GgmlAbiError, GgmlLibraryMissing) as exc:
        log.error("cannot start the host backend (ggml-cpu): %s", exc)
        if npu is not None:
            npu.close()
        return 1
    try:
        server = RpcServer(state, args.host, args.port, protocol=None if args.protocol == "auto" else int(args.protocol))
    except OSError as exc:
        log.error("cannot listen on %s:%d%s: %s", args.host, args.port,
                  " and the next port (--protocol auto)" if args.protocol == "auto" else "", exc)
        state.close()
        if npu is not None:
            npu.close()
        return 1

    def print_stats(*_: object) -> None:
        sys.stderr.write(report.render_stats(state))
        sys.stderr.flush()
        report.write_stats_json(state)

    signals: list[int] = []

    def terminate(signum: int, _frame: object) -> None:
        # The first SIGTERM / SIGINT hangs up on the client and lets its session free everything
        # on its own path (RpcServer.stop); a second one exits at once.
        signals.append(signum)
        if len(signals) > 1:
            raise SystemExit(0)
        server.stop()

    signal.signal(signal.SIGUSR1, print_stats)
    signal.signal(signal.SIGTERM, terminate)
    signal.signal(signal.SIGINT, terminate)
    state.budget, budget_text = for_server(state, args.memory_budget)
    state.memory.host_bytes = state.budget.bytes if state.budget is not None else None
    free, total = state.memory.report()
    log.info("rknpu serve: %s, %s, weights %s, activations %s, device memory %.0f/%.0f MiB "
             "free, host ops on ggml-cpu with %d thread(s)", _listening_text(server, args.host), engine, args.weights,
             _activations_text(args), free / 2**20, total / 2**20, state.threads.n if state.threads else 0)
    log.info("%s; %s; %s", state.board.now(state).render(), budget_text,
             pages.describe() if pages else "no weight pages")
    if state.placer is not None:
        log.info("%s", state.placer.describe())
    try:
        server.serve_forever()
        if signals:
            log.info("stopped by signal %d", signals[0])
    finally:
        print_stats()
        state.close()
        if npu is not None:
            log.info("%s engine counters: %s", args.engine, dict(npu.counters))
            npu.close()
    return 0
