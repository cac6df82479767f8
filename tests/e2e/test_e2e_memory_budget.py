"""``rknpu serve --memory-budget`` with unmodified llama.cpp (``-ngl 99``): a budget smaller than
the model's NPU copies still loads the model, every weight stays host-only (the stats name
them), and the greedy text equals the CPU-only run's; a budget with room stages them all and
gives nothing up; gemma3 with room for about half its copies follows llama.cpp alone, and with
room for its NPU copies but half its repacked ones keeps some weights NPU only (slow)."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
from gguf import GGUFReader

from ggml_rknpu.bench import memory as memory_bench
from ggml_rknpu.server.placement_policy import matmul_kind
from ggml_rknpu.server.residency import HEAD_KINDS, repacks
from ggml_rknpu.toolchain import models
from support.e2e_support import completion, llama_server, rknpu_server, tool_or_skip
from support.gguf_models import write_tiny_gguf
from support.greedy import Choice, agree, choices

pytestmark = [pytest.mark.llama]
PROMPT = "The capital of France is"
N_PREDICT = 12
TINY_MATMUL_WEIGHTS = 2 * 7 + 1    # 2 layers x 7 matmul weights + the output head (tests/support/gguf_models.py)


@pytest.mark.timeout(900)
def test_a_budget_below_the_npu_copies_loads_host_only_with_cpu_text(tmp_path: Path) -> None:
    tool_or_skip("llama-completion")
    model = write_tiny_gguf(tmp_path / "tiny-llama-f16.gguf", "llama", "f16")
    cpu_text, cpu = completion(model, PROMPT, n_predict=N_PREDICT)
    assert cpu.returncode == 0 and cpu_text.strip(), cpu.stderr[-3000:]
    texts, stats = {}, {}
    for name, budget in (("tight", "1"), ("room", "65536")):
        with rknpu_server(tmp_path, extra=("--weights", "fp16", "--memory-budget", budget), name=name) as server:
            text, proc = completion(model, PROMPT, n_predict=N_PREDICT, rpc=server.endpoint, timeout=800)
            assert proc.returncode == 0, f"{proc.stderr[-3000:]}\n--- server ---\n{server.log()}"
            assert server.wait_log(f"memory budget {budget} MiB of board memory (--memory-budget)"), server.log()
            texts[name], stats[name] = text, server.first_stats()
    tight, room = stats["tight"], stats["room"]
    assert tight["weights"]["uploads"] == 0 and len(tight["memory_budget"]["host_only"]) >= TINY_MATMUL_WEIGHTS
    assert "blk.0.ffn_up.weight" in tight["memory_budget"]["host_only"]
    assert tight["host_matmul_reasons"]["NPU copy over the memory budget"] >= TINY_MATMUL_WEIGHTS
    assert room["weights"]["uploads"] >= TINY_MATMUL_WEIGHTS and room["memory_budget"]["host_only"] == {}
    assert tight["board_memory"]["npu"] == 0 < room["board_memory"]["npu_retired"]   # read after the client left
    assert texts["tight"] == cpu_text, f"budgeted {texts['tight']!r} != CPU {cpu_text!r}"
    assert texts["room"] == cpu_text, f"NPU {texts['room']!r} != CPU {cpu_text!r}"


@pytest.mark.timeout(900)
def test_npu_only_weights_under_simulated_faults_keep_the_cpu_text(tmp_path: Path) -> None:
    """Every weight NPU only (``--placement npu``: every M bucket on the NPU, no repacked copy)
    with faults injected at the simulated kernel (seeded rates): a step faulted twice in a row
    runs ggml-cpu's plain kernel on the weight pages, one faulted once is retried on the NPU;
    the text is the CPU's."""
    tool_or_skip("llama-completion")
    model = write_tiny_gguf(tmp_path / "tiny-llama-f16.gguf", "llama", "f16")
    cpu_text, cpu = completion(model, PROMPT, n_predict=N_PREDICT)
    assert cpu.returncode == 0 and cpu_text.strip(), cpu.stderr[-3000:]
    extra = ("--weights", "fp16", "--memory-budget", "65536", "--sim-faults", "timeout:0.3,dma:0.1,seed=1")
    with rknpu_server(tmp_path, extra=extra) as server:
        text, proc = completion(model, PROMPT, n_predict=N_PREDICT, rpc=server.endpoint, timeout=800)
        assert proc.returncode == 0, f"{proc.stderr[-3000:]}\n--- server ---\n{server.log()}"
        first = server.first_stats()
    stats = server.stats()                        # written at exit: every counter of the run
    residency, recovery = first["placement"]["residency"], stats["recovery"]
    assert residency["npu"] >= TINY_MATMUL_WEIGHTS and residency["host"] == residency["both"] == 0, residency
    assert first["host_repacked"] == 0 and first["memory_budget"]["host_only"] == {}
    print(f"recovery {recovery}")
    assert recovery["host_fallbacks"] >= 1 and recovery["retried_ok"] >= 1, recovery
    assert text == cpu_text, f"NPU-only under faults {text!r} != CPU {cpu_text!r}"


# gemma3: a CPU top-2 gap below this is a coin toss between correct devices, and fp16 NPU
# activations move the chosen token's logprob by up to this (tests/e2e/test_e2e_client8.py)
GEMMA_TIE, GEMMA_CLOSE_NPU = 0.2, 0.3
GEMMA_TOKENS = 16
NOTE_PROMPT = memory_bench.PROMPT     # about 115 tokens: the prompt pass is a prefill-bucket pass


def _greedy(server, prompt: str = PROMPT) -> list[Choice]:
    reply = server.post("/completion", {"prompt": prompt, "temperature": 0.0, "n_predict": GEMMA_TOKENS, "seed": 1,
                                        "n_probs": 2, "cache_prompt": False})
    return choices(reply["completion_probabilities"])


@pytest.mark.slow
@pytest.mark.timeout(3000)
def test_gemma3_with_room_for_half_its_npu_copies_agrees_with_the_cpu(tmp_path: Path) -> None:
    """gemma-3-270m through llama-server on the simulated NPU: first with no room (every weight
    host-only; the board bytes its copies were weighed against are read from the stats), then
    with room for the repacked host copies a host-only weight keeps and about half its layers'
    fp16 NPU copies: some weights staged, the rest named host-only, both answers following
    llama-server alone's by the near-tie rule."""
    tool_or_skip("llama-server")
    try:
        model = models.gemma3_270m(install=True)
    except models.ModelUnavailable as exc:
        pytest.skip(str(exc))
    with llama_server(tmp_path, model, rpc=None) as alone:
        cpu = _greedy(alone)
    _, host_bytes, head_bytes = _copy_bytes(model)
    answers, stats = {}, {}
    budget = "1"
    for name in ("none", "half"):
        with rknpu_server(tmp_path, extra=("--weights", "fp16", "--memory-budget", budget), name=name) as server:
            with llama_server(tmp_path, model, rpc=server.endpoint) as client:
                answers[name] = _greedy(client)
            stats[name] = server.first_stats()
        mb = stats[name]["memory_budget"]
        layers = sorted(mb["host_only"].values())[:-1]          # the largest (the tied head) alone fills half
        budget = str((mb["board_at_admission"] + head_bytes + host_bytes + sum(layers) // 2) >> 20)
    none, half = stats["none"], stats["half"]
    assert none["weights"]["uploads"] == 0 and len(none["memory_budget"]["host_only"]) > 100
    staged, kept = half["weights"]["uploads"], len(half["memory_budget"]["host_only"])
    print(f"\nhalf the room: {staged} weights staged, {kept} host-only")
    assert staged > 10 and kept > 10, half["memory_budget"]
    for name, tie_close in (("none", GEMMA_TIE), ("half", GEMMA_CLOSE_NPU)):
        agreement = agree(answers[name], cpu, tie=GEMMA_TIE, close=tie_close, what=f"gemma3, budget {name}")
        assert agreement.compared >= 8, agreement


def _copy_bytes(model: Path) -> tuple[int, int, int]:
    """(int8 NPU bytes, repacked host bytes) of the layers' 2-D weights, and the head's repacked
    bytes (cost placement keeps the head host only: a prompt reads it at one row), by the byte
    model the residency prices with (an element per weight; a repacked copy as large as the
    GGUF bytes, for the types and row counts ggml-cpu repacks on the board)."""
    npu = host = head = 0
    for t in GGUFReader(model).tensors:
        if len(t.shape) == 2 and t.name.endswith(".weight") and "norm" not in t.name:
            k, n = (int(x) for x in t.shape)
            repacked = int(t.n_bytes) if repacks(int(t.tensor_type), n) else 0
            if matmul_kind(t.name) in HEAD_KINDS:
                head += repacked
            else:
                npu, host = npu + n * k, host + repacked
    return npu, host, head


@pytest.mark.slow
@pytest.mark.timeout(3000)
def test_gemma3_with_room_for_npu_copies_but_not_all_repacked_ones_keeps_some_npu_only(tmp_path: Path) -> None:
    """gemma-3-270m through llama-server on the simulated NPU, placed by cost (int8 NPU
    weights, host matmuls priced at one A76 thread: every layer wants both copies, decode on the
    host, the prompt on the NPU), with room for every NPU copy and half the repacked host
    copies: the FFN weights, whose decode passes lose the least on the NPU per byte, keep their
    NPU copy only (no repacked copy made, the stats name them); the greedy tokens follow
    llama-server alone's (near-tie rule)."""
    tool_or_skip("llama-server")
    try:
        model = models.gemma3_270m(install=True)
    except models.ModelUnavailable as exc:
        pytest.skip(str(exc))
    with llama_server(tmp_path, model, rpc=None) as alone:
        cpu = _greedy(alone, NOTE_PROMPT)
    npu_bytes, host_bytes, head_bytes = _copy_bytes(model)
    answers, stats, board = {}, {}, 0
    # the probe (no room: host only) reads the board bytes the copies are weighed against; "room"
    # keeps both copies of every layer; "half" has room for the NPU copies and half the repacked ones
    for name in ("probe", "room", "half"):
        budget = {"probe": 1, "room": 65536, "half": (board + head_bytes + npu_bytes + host_bytes // 2) >> 20}[name]
        extra = ("--weights", "int8", "--host-threads", "1", "--placement", "auto", "--memory-budget", str(budget))
        with rknpu_server(tmp_path, extra=extra, name=name) as server:
            with llama_server(tmp_path, model, rpc=server.endpoint) as client:
                answers[name] = _greedy(client, NOTE_PROMPT)
            stats[name] = server.first_stats()
            assert server.wait_log("residency of"), server.log()
        board = board or stats[name]["memory_budget"]["board_at_admission"]
    half = stats["half"]
    npu_only, host_only = half["memory_budget"]["npu_only"], half["memory_budget"]["host_only"]
    residency = half["placement"]["residency"]
    print(f"\nroom for the NPU copies and half the repacked ones: {residency}, "
          f"{sum(npu_only.values()) / 2**20:.1f} MiB of repacked copies given up")
    assert stats["room"]["placement"]["residency"]["npu"] == 0 < stats["room"]["placement"]["residency"]["both"]
    assert residency["npu"] == len(npu_only) > 0 and residency["both"] > 0
    assert all(".ffn_" in name for name in npu_only), npu_only
    assert half["host_repacked"] <= residency["both"] + residency["host"]      # none for an NPU-only weight
    assert not set(npu_only) & set(host_only)
    # int8 NPU weights move a pass's logprobs by more than fp16's bound (and short prompts' text
    # away from the CPU's after a few tokens, docs/llama-cpp.md): the tokens are held to
    # llama-server alone's by the near-tie rule, the logprobs are not compared
    for name in ("room", "half"):
        agreement = agree(answers[name], cpu, tie=GEMMA_TIE, close=math.inf, what=f"gemma3 int8, {name}")
        assert agreement.compared >= 8, (name, agreement)
