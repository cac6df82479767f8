"""Tiny random llama / qwen2 / qwen3 models through unmodified ``llama-completion --rpc -ngl 99``
with ``rknpu serve`` (simulated NPU) as the device: greedy output equals the CPU-only run, for
every client build (the pinned llama.cpp and b11434, scripts/build-llama-cpp).

Greedy comparison is on the generated text: it is the concatenation of the sampled tokens'
pieces, so a different token choice shows up as different text. The offload itself is checked
too (the server's counters must show the weights uploaded to the NPU and the attention op of the
chosen path executed), so a run that silently stayed on the CPU cannot pass.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from ggml_rknpu.toolchain.llamacpp import CLIENTS
from support.e2e_support import completion, rknpu_server, tool_or_skip
from support.gguf_models import ARCHES, MORE_ARCHES, write_tiny_gguf

pytestmark = [pytest.mark.llama]
PROMPT = "The capital of France is"
N_PREDICT = 12


# 2 layers x 7 matmul weights + the output head (tests/support/gguf_models.py)
TINY_MATMUL_WEIGHTS = 2 * 7 + 1


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    tool_or_skip("llama-completion")
    root = tmp_path_factory.mktemp("tiny")
    return {arch: write_tiny_gguf(root / f"tiny-{arch}-f16.gguf", arch, "f16") for arch in ARCHES}


# flash attention: "on" sends FLASH_ATTN_EXT; "off" sends KQ/KQV MUL_MATs and SOFT_MAX instead
ATTENTION_OP = {"on": "FLASH_ATTN_EXT", "off": "SOFT_MAX"}


@pytest.mark.timeout(900)
@pytest.mark.parametrize("fa", sorted(ATTENTION_OP))
@pytest.mark.parametrize("arch", ARCHES)
@pytest.mark.parametrize("client", CLIENTS)
def test_greedy_tokens_equal_cpu(tmp_path: Path, models: dict[str, Path], arch: str, fa: str, client: str) -> None:
    tool_or_skip("llama-completion", client)
    flags = ("-fa", fa)
    cpu_text, cpu = completion(models[arch], PROMPT, n_predict=N_PREDICT, extra=flags, client=client)
    assert cpu.returncode == 0, cpu.stderr[-3000:]
    with rknpu_server(tmp_path, extra=("--weights", "fp16")) as server:
        text, proc = completion(models[arch], PROMPT, n_predict=N_PREDICT, rpc=server.endpoint, extra=flags,
                                timeout=800, client=client)
        assert proc.returncode == 0, f"{proc.stderr[-3000:]}\n--- server ---\n{server.log()}"
        assert server.alive(), server.log()
    assert server.weight_uploads() >= TINY_MATMUL_WEIGHTS, server.log()
    assert server.nodes(ATTENTION_OP[fa]) > 0, server.stats()["per_op"]
    assert cpu_text.strip(), cpu.stderr[-2000:]
    assert text == cpu_text, f"RPC {text!r} != CPU {cpu_text!r}\n--- server ---\n{server.log()}"


@pytest.mark.timeout(900)
def test_two_servers_split_same_tokens_as_one(tmp_path: Path, models: dict[str, Path]) -> None:
    """llama.cpp splits the layers over two servers (``--rpc a,b -ts 1,1``): same text as one server."""
    model = models["llama"]
    with rknpu_server(tmp_path, extra=("--weights", "fp16"), name="one") as server:
        one_text, one = completion(model, PROMPT, n_predict=N_PREDICT, rpc=server.endpoint, timeout=800)
    assert one.returncode == 0, f"{one.stderr[-3000:]}\n{server.log()}"
    with rknpu_server(tmp_path, extra=("--weights", "fp16"), name="a") as a, \
            rknpu_server(tmp_path, extra=("--weights", "fp16"), name="b") as b:
        text, proc = completion(model, PROMPT, n_predict=N_PREDICT, rpc=f"{a.endpoint},{b.endpoint}",
                                extra=("-ts", "1,1"), timeout=800)
        assert proc.returncode == 0, f"{proc.stderr[-3000:]}\n--- a ---\n{a.log()}\n--- b ---\n{b.log()}"
    # each server holds part of the model, together all of it
    split = [a.weight_uploads(), b.weight_uploads()]
    assert min(split) > 0 and sum(split) >= TINY_MATMUL_WEIGHTS, f"staged per server: {split}"
    assert text == one_text, f"split {text!r} != one server {one_text!r}"


# the ops that prove each architecture's own path ran on the server
ARCH_OPS = {"qwen3moe": ("MUL_MAT_ID", "ARGSORT"), "mamba": ("SSM_CONV", "SSM_SCAN"),
            "jamba": ("SSM_SCAN", "MUL_MAT_ID", "SOFT_MAX")}


@pytest.mark.timeout(900)
@pytest.mark.parametrize("arch", MORE_ARCHES)
def test_moe_ssm_hybrid_greedy_tokens_equal_cpu(tmp_path: Path, arch: str) -> None:
    """A MoE (qwen3moe), an SSM (mamba) and a hybrid (jamba: mamba + attention + MoE layers) with
    fp16 weights: the same greedy text through --rpc as CPU-only, their own ops run by the server;
    the MoE experts resident on the NPU, every MUL_MAT_ID and expert matmul run there."""
    tool_or_skip("llama-completion")
    model = write_tiny_gguf(tmp_path / f"tiny-{arch}-f16.gguf", arch, "f16")
    cpu_text, cpu = completion(model, PROMPT, n_predict=N_PREDICT)
    assert cpu.returncode == 0, cpu.stderr[-3000:]
    with rknpu_server(tmp_path, extra=("--weights", "fp16")) as server:
        text, proc = completion(model, PROMPT, n_predict=N_PREDICT, rpc=server.endpoint, timeout=800)
        assert proc.returncode == 0, f"{proc.stderr[-3000:]}\n--- server ---\n{server.log()}"
        assert server.alive(), server.log()
    for op in ARCH_OPS[arch]:
        assert server.nodes(op) > 0, (op, server.stats()["per_op"])
    assert server.weight_uploads() > 0, server.log()
    if "MUL_MAT_ID" in ARCH_OPS[arch]:
        stats = server.stats()
        moe = {r["engine"]: r["nodes"] for r in stats["per_op"] if r["op"] == "MUL_MAT_ID"}
        assert moe.get("npu", 0) > 0 and "host" not in moe, moe
        assert stats["expert_matmuls_npu"] > 0 and stats["expert_matmuls_host"] == 0, stats
    assert cpu_text.strip(), cpu.stderr[-2000:]
    assert text == cpu_text, f"RPC {text!r} != CPU {cpu_text!r}\n--- server ---\n{server.log()}"


def _decode_submits(tmp_path: Path, model: Path, extra: tuple[str, ...]) -> tuple[float, str, dict]:
    """NPU submits per decoded token: two servers (stats written at their exit) decode 4 and
    12 tokens of the same prompt; the difference is 8 decode passes (prefill and warm-up cancel)."""
    submits, text, stats = [], "", {}
    for n in (4, 12):
        with rknpu_server(tmp_path, extra=("--weights", "fp16", *extra), name=f"submits-{n}") as server:
            text, proc = completion(model, PROMPT, n_predict=n, rpc=server.endpoint, timeout=800)
            assert proc.returncode == 0, f"{proc.stderr[-3000:]}\n--- server ---\n{server.log()}"
        stats = server.stats()
        submits.append(stats["engine"]["submits"])
    return (submits[1] - submits[0]) / 8, text, stats


@pytest.mark.timeout(900)
@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_decode_runs_at_most_four_submits_per_layer(tmp_path: Path, models: dict[str, Path], arch: str) -> None:
    """Q/K/V and gate/up each one chained submit: 4 per layer (QKV, O, gate+up, down) + the
    output head per decoded token; ``--no-fuse`` (one per matmul, 7 per layer) decodes the same text."""
    per_token, text, stats = _decode_submits(tmp_path, models[arch], ())
    assert per_token == 4 * 2 + 1, (per_token, stats["engine"])
    assert stats["npu_grouped_runs"] > 0 and stats["engine"]["chained_submits"] > 0
    ungrouped, text_unfused, stats = _decode_submits(tmp_path, models[arch], ("--no-fuse",))
    assert ungrouped == TINY_MATMUL_WEIGHTS and stats["npu_groups_planned"] == 0, stats["engine"]
    cpu_text, cpu = completion(models[arch], PROMPT, n_predict=12)
    assert cpu.returncode == 0, cpu.stderr[-3000:]
    assert text == text_unfused == cpu_text
