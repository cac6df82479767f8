"""The bring-up ladder: rungs from safest to riskiest, each run through the real engine with
canary-armed outputs and compared with numpy, stopping at the first failure.

Invariants: a rung compiles in the envelope the rungs below it proved plus its own
widening, and checks from the compiled words that the program really exercises that
widening; the rungs a board passed are recorded (``engine.envelope_record``) and are what
widens the envelope the engine plans in. Why and the test hooks: docs/decisions.md
"bench/ladder.py"; the rungs: docs/envelope.md."""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from ggml_rknpu.engine.envelope_record import RUNGS, envelope_for_rungs
from ggml_rknpu.hw.envelope import PROVEN, decode_task, walk_chain

if TYPE_CHECKING:   # the compiler loads when a rung runs
    from ggml_rknpu.compiler.program import Program, ProgramTask

CORRUPT_ENV = "RKNPU_SELFTEST_CORRUPT"
FAULT_ENV = "RKNPU_SELFTEST_FAULT"
FAULTS = ("stale", "timeout")

# What each failure looks like, to compare a board's report with.
SYMPTOMS = {
    "timeout": "the submit did not complete within the driver's timeout (vendor: ETIMEDOUT after a soft "
               "reset): a hang, a task the hardware rejected, or an interrupt it never raised",
    "stale": "output canaries survived: at least one task never wrote its output (rocket: a job killed at "
             "its 500 ms timeout returns stale data with no error; vendor: a dropped chain task)",
    "wrong values": "every task wrote, but some values differ from numpy; where they sit (whole rows, a "
                    "block of columns, one K chunk's share) says which tile, bank or address rule is wrong",
    "not exercised": "the compiled program does not use what the rung claims to test (a ladder defect)",
    "error": "the engine or driver refused the rung (message attached)",
}


@dataclass(frozen=True)
class Rung:
    name: str
    what: str
    cases: tuple[tuple, ...]                            # (M, K, N, dtype[, out])
    exercises: Callable[[Any], bool]                    # on the compiled Program
    cores: int = 1
    abi: str | None = None                              # only under this driver


@dataclass
class RungResult:
    name: str
    what: str
    status: str                         # "pass" | "FAIL" | "skipped"
    envelope: str
    symptom: str | None = None
    detail: str | None = None
    cases: list[dict] = field(default_factory=list)
    seconds: float = 0.0


def _chains(program: Program) -> list[list]:
    words = program.bind(a=0, b=0, c=0, regcmd=0)
    heads: dict[tuple[int, int], ProgramTask] = {}
    for t in program.tasks:
        heads.setdefault((t.core, t.chain), t)
    return [walk_chain(words, t.word_offset, t.body_words + 4) for t in heads.values()]


def _job_ms(program) -> float:
    """Modeled ms of the program's longest job at the clock rocket jobs are sized at."""
    from ggml_rknpu.cost.model import TaskWork, task_seconds
    from ggml_rknpu.hw import limits

    out = limits.BYTES[program.c_dtype]
    return 1e3 * max(sum(task_seconds(TaskWork(0, t.rows, t.chunk_k, t.kernels, t.dtype, out),
                                      npu_mhz=PROVEN.job_model_mhz) for t in chain) for chain in _chains(program))


def _tasks(program) -> list:
    return [decode_task(program.words[t.word_offset: t.word_offset + t.body_words]) for t in program.tasks]


def golden_shapes() -> tuple[tuple, ...]:
    """The 15 MTX golden shapes and modes, as (M, K, N, dtype, out): compiled, they are the
    golden streams word for word (tests/compiler/test_compiler_golden.py)."""
    fp32 = [(1, 32, 16), (1, 64, 64), (1, 1024, 1024), (1, 4096, 4096), (4, 32, 16), (384, 384, 4096)]
    fp16 = [(1, 32, 16), (1, 768, 768), (1, 768, 2048), (1, 8192, 8192)]
    int8 = [(1, 32, 32), (1, 64, 64), (1, 1024, 1024), (1, 4096, 4096), (544, 544, 4096)]
    return (tuple((m, k, n, "fp16", "fp32") for m, k, n in fp32) + tuple((m, k, n, "fp16", "fp16") for m, k, n in fp16)
            + tuple((m, k, n, "int8", "int32") for m, k, n in int8))


LADDER: tuple[Rung, ...] = (
    Rung("golden", "the hardware-checked MTX single-task shapes, one task each",
         golden_shapes(), lambda p: len(p.tasks) == 1),
    Rung("chain_fp16", "a 65-task fp16 PC chain (the longest vendor chain captured)",
         ((1, 32, 64 * 8192 + 16, "fp16"),), lambda p: max(map(len, _chains(p))) >= 65),
    Rung("chain_int8", "16-task int8 chains (no multi-task int8 stream has run before)",
         ((2, 256, 16 * 4096 + 32, "int8"),), lambda p: max(map(len, _chains(p))) >= 16),
    Rung("long_k", "K split in chunks of multiples of 256, partials summed on the host",
         ((3, 16384, 64, "fp16"), (3, 8192, 64, "int8")), lambda p: p.k_splits > 1),
    Rung("full_weight_bank", "a kernel group filling all of WEIGHT_BANK (fill 1.0 > 0.73)",
         ((32, 4096, 64, "fp16"),), lambda p: max(t.weight_fill for t in _tasks(p)) == 1),
    Rung("feature_grains", "1022 rows in one task (FEATURE_GRAINS 1023 > 545)",
         ((1022, 32, 16, "fp16"),), lambda p: max(t.feature_grains for t in _tasks(p)) == 1023),
    Rung("two_cores", "one submit on two cores (vendor core_mask 0x3)",
         ((64, 256, 64, "fp16"), (64, 256, 64, "int8")), lambda p: p.cores_used == 2, cores=2),
    Rung("three_cores", "one submit on all three cores (core_mask 0x7)",
         ((96, 256, 96, "fp16"), (96, 256, 96, "int8")), lambda p: p.cores_used == 3, cores=3),
    Rung("long_rocket_job", "one rocket job modeled at 338 ms at the 200 MHz boot clock (timeout 500 ms)",
         ((2048, 2048, 4096, "fp16"),), lambda p: p.n_submits == 1 and _job_ms(p) > PROVEN.max_job_ms,
         abi="rocket"),
)
assert tuple(r.name for r in LADDER) == RUNGS, "the ladder and the envelope record list the same rungs"


def _hooks() -> tuple[str | None, tuple[str, str] | None]:
    corrupt = os.environ.get(CORRUPT_ENV) or None
    fault = os.environ.get(FAULT_ENV) or None
    parsed = None
    if fault:
        rung, _, kind = fault.partition(":")
        if kind not in FAULTS:
            raise ValueError(f"{FAULT_ENV}={fault!r}: expected <rung>:<{'|'.join(FAULTS)}>")
        parsed = (rung, kind)
    return corrupt, parsed


def run_program(dev, program, a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Run one compiled program on ``dev`` with canary-armed output; C [M, N]. Raises
    NpuFault when a canary survives (a task did not write). Under rocket a program on several
    cores runs from a file per core (``bench.per_file``)."""
    from ggml_rknpu.bench.per_file import run_per_file
    from ggml_rknpu.compiler.layout import pack_a, pack_b, unpack_c
    from ggml_rknpu.engine.bound_program import program_jobs
    from ggml_rknpu.engine.canary import Canaries
    from ggml_rknpu.kernel.errors import NpuFault

    dtype = program.shape.dtype
    bufs = [dev.alloc(max(n, 1)) for n in (program.a_bytes, program.b_bytes, program.c_bytes)]
    regcmd = dev.alloc(program.regcmd_bytes, purpose="regcmd")
    try:
        A, B, C = bufs
        pack_a(a, dtype, program, out=A.array())
        pack_b(b, dtype, program, out=B.array())
        B.sync_to_device()
        words = program.bind(a=A.dma_addr, b=B.dma_addr, c=C.dma_addr, regcmd=regcmd.dma_addr)
        regcmd.array(np.uint64)[: words.size] = words
        canaries = Canaries.for_program(program)
        canaries.arm(C.array())
        if dev.kind == "rocket" and program.cores_used > 1:   # a file per core: side by side
            run_per_file(dev, program, A.array(), B.array(), C.array())
        else:
            for job in program_jobs(program, regcmd.dma_addr, dev.n_cores, A, C):
                dev.submit(job)
        unwritten = canaries.unwritten(C.array())
        if unwritten:
            raise NpuFault(f"{unwritten} output canaries left unwritten: a task did not finish")
        return unpack_c(C.array(), program, program.shape.M)
    finally:
        for buf in (*bufs, regcmd):
            buf.close()


def run_rung(rung: Rung, device: str | None, passed: list[str], *, corrupt: bool = False,
             fault: str | None = None, seed: int = 1234) -> RungResult:
    """One rung in the envelope ``passed`` proved plus its own widening."""
    from ggml_rknpu.bench import matmul as mm
    from ggml_rknpu.bench.verdict import compare, corrupt_one
    from ggml_rknpu.compiler.matmul import compile_matmul
    from ggml_rknpu.devices import open_device
    from ggml_rknpu.kernel.errors import NpuFault, NpuTimeout

    t0 = time.perf_counter()
    dev = open_device(device)
    env = envelope_for_rungs([*passed, rung.name], dev.kind)
    result = RungResult(rung.name, rung.what, "pass", env.name)
    try:
        if rung.abi and dev.kind != rung.abi:
            result.status, result.detail = "skipped", f"only under the {rung.abi} driver"
            return result
        if fault:
            if not dev.simulated:
                raise ValueError(f"{FAULT_ENV} injects faults in the simulator only")
            from ggml_rknpu.sim.kernel import SimKernel

            if not isinstance(dev.syscalls, SimKernel):
                raise ValueError(f"{FAULT_ENV} injects faults into the simulated kernel itself, not a wrapper of it "
                                 "(unset RKNPU_TRACE)")
            dev.syscalls.inject = fault
        rng = np.random.default_rng(seed)
        for M, K, N, dtype, *given_out in rung.cases:
            out = given_out[0] if given_out else ("int32" if dtype == "int8" else "fp32")
            a, b = mm.make_operands(mm.Shape("ladder", K, N, "ladder"), M, dtype, rng)
            case = {"M": M, "K": K, "N": N, "dtype": dtype, "out": out}
            result.cases.append(case)
            try:
                program = compile_matmul(M, K, N, dtype=dtype, out=out,
                                         cores=min(rung.cores, env.max_cores, dev.n_cores), abi=dev.kind,
                                         envelope=env)
                case.update(tasks=len(program.tasks), submits=program.n_submits, cores=program.cores_used)
                if not rung.exercises(program):
                    return _fail(result, "not exercised", f"{len(program.tasks)} tasks, {program.n_submits} "
                                                          f"submits, {program.cores_used} cores")
                c = run_program(dev, program, a, b)
            except NpuTimeout as exc:
                return _fail(result, "timeout", exc)
            except NpuFault as exc:
                return _fail(result, "stale" if "canar" in str(exc) else "error", exc)
            except Exception as exc:  # a refused rung is a result; the ladder stops there
                return _fail(result, "error", exc)
            if corrupt:
                corrupt_one(c)
                corrupt = False
            ok, max_err, n_bad, first = compare(c, a, b, dtype)
            case.update(ok=ok, max_abs_err=max_err, mismatches=n_bad)
            if not ok:
                return _fail(result, "wrong values", f"{n_bad} element(s), first {first}")
        return result
    finally:
        dev.close()
        result.seconds = time.perf_counter() - t0


def _fail(result: RungResult, symptom: str, detail: Any) -> RungResult:
    result.status, result.symptom = "FAIL", symptom
    result.detail = detail if isinstance(detail, str) else f"{type(detail).__name__}: {detail}"
    return result


def run_ladder(device: str | None, rungs: tuple[str, ...] | None = None, advance=lambda n=1: None) -> list[RungResult]:
    """Rungs in order until the first failure (``rungs``: a subset by name, for tests)."""
    corrupt, fault = _hooks()
    passed: list[str] = []
    results = []
    for rung in LADDER:
        if rungs is not None and rung.name not in rungs:
            continue
        is_target = corrupt in (rung.name,)
        kind = fault[1] if fault and fault[0] == rung.name else None
        r = run_rung(rung, device, passed, corrupt=is_target, fault=kind)
        results.append(r)
        advance(1)
        if r.status == "FAIL":
            break
        passed.append(rung.name)
    return results


def passed_rungs(results: list[RungResult]) -> list[str]:
    """Rungs passed, skipped ones included (they do not apply to this driver)."""
    out = []
    for r in results:
        if r.status == "FAIL":
            break
        out.append(r.name)
    return out


def record(device_name: str | None, results: list[RungResult], report: str = "") -> tuple[str, Path]:
    """Save what this board and driver passed (engine.envelope_record); returns (key, file)."""
    from ggml_rknpu.devices import open_device
    from ggml_rknpu.engine.envelope_record import board_key, save_passed

    with open_device(device_name) as dev:
        key = board_key(dev)
    passed = [r.name for r in results if r.status == "pass"]
    return key, save_passed(key, passed_rungs(results) if passed else [], report)


def as_rows(results: list[RungResult]) -> list[dict]:
    return [{"rung": r.name, "status": r.status, "what": r.what, "envelope": r.envelope,
             "symptom": r.symptom or "", "detail": (r.detail or "")[:300], "seconds": round(r.seconds, 2),
             "cases": json.dumps(r.cases)} for r in results]
