"""The proven envelope: its bounds are those of the hardware-run sources, and every program
compiled in it stays inside it, field by field, as decoded with ``hw`` from its words
(walking the PC chains through the tails, not reading the compiler's own tiling)."""

from __future__ import annotations

import json
from fractions import Fraction

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ggml_rknpu.compiler.matmul import compile_matmul
from ggml_rknpu.compiler.tiling import k_chunks
from ggml_rknpu.cost.model import TaskWork, task_seconds
from ggml_rknpu.hw import limits
from ggml_rknpu.hw.envelope import (
    EXTENDED,
    PROVEN,
    ROCKET_BOOT_MHZ,
    ROCKET_JOB_TIMEOUT_MS,
    chain_violations,
    decode_task,
    program_k_violations,
    task_violations,
    walk_chain,
)

MODES = [("fp16", "fp32"), ("fp16", "fp16"), ("int8", "int32")]
# hidden sizes, FFN sizes and vocabularies of Qwen2.5-1.5B, Qwen3-0.6B, Llama-3.2-1B
LLM_DIMS = [896, 1024, 1536, 2048, 3072, 4096, 5632, 8192, 8960, 11008]
LLM_M = [1, 2, 3, 4, 8, 16, 17, 64, 128, 256, 512, 1024, 2048]


def decoded_chains(program):
    """Every chain of ``program`` as TaskFields, reached from each chain's first task by the
    tails in the words (bound with every buffer at 0, so addresses are offsets)."""
    words = program.bind(a=0, b=0, c=0, regcmd=0)
    heads, seen = [], set()
    for t in program.tasks:
        if (t.core, t.chain) not in seen:
            seen.add((t.core, t.chain))
            heads.append(t)
    return [walk_chain(words, h.word_offset, h.body_words + 4) for h in heads]


def assert_inside(program, env, abi):
    chains = decoded_chains(program)
    tasks = [t for chain in chains for t in chain]
    assert len(tasks) == len(program.tasks)                       # the tails reach every task once
    problems = [v for t in tasks for v in task_violations(t, env)]
    problems += [v for chain in chains for v in chain_violations(chain, env, abi)]
    problems += program_k_violations(tasks, env)
    assert not problems, problems
    assert program.cores_used <= env.max_cores
    if abi == "rocket":
        out_bytes = limits.BYTES[program.c_dtype]
        for chain in chains:
            ms = 1e3 * sum(task_seconds(TaskWork(0, t.rows, t.chunk_k, t.kernels, t.dtype, out_bytes),
                                        npu_mhz=ROCKET_BOOT_MHZ, cores_in_job=program.cores_used) for t in chain)
            assert ms <= env.max_job_ms or len(chain) == 1


llm_shapes = st.tuples(st.sampled_from(LLM_M), st.sampled_from(LLM_DIMS), st.sampled_from(LLM_DIMS),
                       st.sampled_from(MODES), st.integers(1, 3), st.sampled_from(["rknpu", "rocket"]))
any_shapes = st.tuples(st.integers(1, 2048), st.integers(1, 20000), st.integers(1, 12000),
                       st.sampled_from(MODES), st.integers(1, 3), st.sampled_from(["rknpu", "rocket"]))


@settings(max_examples=40, deadline=None)
@given(llm_shapes)
def test_llm_shapes_compiled_in_the_proven_envelope_stay_inside_it(args):
    M, K, N, mode, cores, abi = args
    assert_inside(compile_matmul(M, K, N, dtype=mode[0], out=mode[1], cores=cores, abi=abi), PROVEN, abi)


@settings(max_examples=25, deadline=None)
@given(any_shapes)
def test_any_shape_compiled_in_the_proven_envelope_stays_inside_it(args):
    M, K, N, mode, cores, abi = args
    try:
        program = compile_matmul(M, K, N, dtype=mode[0], out=mode[1], cores=cores, abi=abi)
    except ValueError as exc:          # beyond one hardware run: the engine splits along M
        assert "4095" in str(exc)
        return
    assert_inside(program, PROVEN, abi)


def test_extended_programs_leave_the_proven_envelope_where_the_issue_says():
    """The checks can fail: today's (extended) tiling of these shapes is outside PROVEN."""
    p = compile_matmul(512, 4096, 4096, cores=3, envelope="extended")
    tasks = [t for chain in decoded_chains(p) for t in chain]
    assert p.cores_used == 3
    assert any("WEIGHT_BANK" in v for t in tasks for v in task_violations(t, PROVEN))     # fill 1.0
    p = compile_matmul(1000, 64, 64, envelope="extended")
    assert any("FEATURE_GRAINS" in v for t in decoded_chains(p)[0] for v in task_violations(t, PROVEN))
    p = compile_matmul(2048, 96, 11008, dtype="int8", out="int32", envelope="extended")
    assert any("entries" in v for t in decoded_chains(p)[0] for v in task_violations(t, PROVEN))
    p = compile_matmul(64, 39 * 32 * 8, 64, envelope="extended")                       # K 9984: 1248-ch chunks
    assert any("multiple of 256" in v for v in program_k_violations(
        [t for c in decoded_chains(p) for t in c], PROVEN))


def test_proven_splits_chains_and_k_as_the_sources_allow():
    # int8 beyond one task: one task per vendor submit (no multi-task int8 stream ran)
    p = compile_matmul(1, 1536, 8960, dtype="int8", out="int32", cores=3)
    assert p.cores_used == 1 and p.n_submits == len(p.tasks) == 3
    # fp16 chains: at most 65 tasks per vendor submit
    p = compile_matmul(2048, 4096, 4096)
    assert max(len(c) for c in decoded_chains(p)) <= 65 and p.n_submits >= 2
    # int8 K beyond 4096 splits into multiples of 256
    chunks = k_chunks(8192, "int8")
    assert len(chunks) >= 2 and all(c.size % 256 == 0 and c.size <= 4096 for c in chunks)
    assert all(c.size % 256 == 0 for c in k_chunks(8960, "fp16")[:-1])


def test_rocket_jobs_stay_under_half_the_driver_timeout_at_the_boot_clock():
    """2048x4096x11008 on one core: modeled ~3 s at 200 MHz in one job before; now chains."""
    p = compile_matmul(2048, 4096, 11008, abi="rocket")
    assert p.n_submits > 1
    assert_inside(p, PROVEN, "rocket")
    assert PROVEN.max_job_ms == ROCKET_JOB_TIMEOUT_MS / 2


# --- the envelope's bounds are those of its sources -----------------------------------
def golden_tasks(reference_dir):
    cases = json.loads((reference_dir / "golden/mtx512-single-task.json").read_text())["cases"]
    return [(c, decode_task([int(w, 16) for w in c["words"]])) for c in cases]


def test_every_golden_stream_is_inside_the_proven_envelope(reference_dir):
    for case, task in golden_tasks(reference_dir):
        assert not task_violations(task, PROVEN), (case["M"], case["K"], case["N"], case["mode"])


def test_proven_bounds_are_the_golden_maxima(reference_dir):
    tasks = [t for _, t in golden_tasks(reference_dir)]
    assert max(t.weight_fill for t in tasks) == PROVEN.max_weight_fill == Fraction(8, 11)
    assert max(t.feature_grains for t in tasks) == PROVEN.max_feature_grains == 545
    for dtype in ("fp16", "int8"):
        assert max(t.chunk_k for t in tasks if t.dtype == dtype) == PROVEN.max_chunk_k[dtype]
        assert max(t.kernels for t in tasks if t.dtype == dtype) == PROVEN.max_task_n[dtype]


def test_vendor_captures_chain_length_and_fill_are_within_the_proven_bounds(reference_dir):
    decoded = sorted((reference_dir / "captures/decoded").glob("*.json"))
    assert decoded, "the decoded vendor captures are committed under tests/data/oracle/captures/decoded"
    R = limits
    longest, fills = 0, []
    for path in decoded:
        d = json.loads(path.read_text())
        longest = max(longest, d["task_count"])
        for row in d["body_rows"]:
            if any(row.get(k) is None for k in ("cbuf0", "weight_size1", "weight_size2", "conv_con1")):
                continue                                   # PPU separator tasks carry no conv
            weight_bank = (row["cbuf0"] >> 4) & 0xF
            kernels = row["weight_size2"] & 0x3FFF
            dtype = "int8" if (row["conv_con1"] >> 4) & 0x7 == 0 else "fp16"
            group = min(R.KERNEL_GROUP[dtype], kernels) * row["weight_size1"]
            if weight_bank and kernels and group <= R.CBUF_BANK_BYTES * weight_bank:
                fills.append(Fraction(group, weight_bank * R.CBUF_BANK_BYTES))
    assert longest == PROVEN.max_chain_tasks["fp16"] == 65
    assert max(fills) <= PROVEN.max_weight_fill


def test_extended_is_wider_than_proven_in_every_field():
    assert EXTENDED.max_cores > PROVEN.max_cores and EXTENDED.max_feature_grains > PROVEN.max_feature_grains
    assert EXTENDED.max_weight_fill > PROVEN.max_weight_fill
    assert all(EXTENDED.max_chain_tasks[d] >= PROVEN.max_chain_tasks[d] for d in ("fp16", "int8"))
    widened = PROVEN.widen(max_cores=3)
    assert widened.max_cores == 3 and widened.max_feature_grains == 545 and "max_cores" in widened.name


@pytest.mark.parametrize("abi", ["rknpu", "rocket"])
@pytest.mark.parametrize("M,K,N", [(16, 8192, 2048), (16, 6912, 1152), (9, 8192, 2048), (12, 7000, 100)])
def test_split_k_of_decode_rows_stays_inside_the_proven_envelope(M, K, N, abi):
    """One-group tasks over parts of a weight chunk (tiling.group_split): chunks of
    multiples of 256, chains of at most 65 fp16 tasks, fill within 8/11, one core."""
    program = compile_matmul(M, K, N, dtype="fp16", out="fp32", cores=3, abi=abi)
    assert program.k_splits == 2 and program.n_submits >= (2 if abi == "rknpu" and N >= 1024 else 1)
    assert_inside(program, PROVEN, abi)
