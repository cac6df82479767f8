"""``rknpu demo`` (the README's main command): serves gemma3-270m on the simulated NPU and prints text."""

from __future__ import annotations

import subprocess
import sys

import pytest

from support.e2e_support import tool_env, tool_or_skip


def test_bad_token_count_is_refused_before_any_work() -> None:
    proc = subprocess.run([sys.executable, "-m", "ggml_rknpu.cli.main", "demo", "-n", "0"],
                          capture_output=True, text=True, timeout=120, env=tool_env())
    assert proc.returncode == 2 and "--n-predict must be positive" in proc.stderr


@pytest.mark.llama
@pytest.mark.timeout(1800)
def test_demo_generates_text_with_the_real_model() -> None:
    """What a terminal shows (stdout and stderr in one stream): the text, whole on its line, and
    the server's staging bar and log on their own lines, never inside the text."""
    tool_or_skip("llama-completion")
    proc = subprocess.run([sys.executable, "-m", "ggml_rknpu.cli.main", "demo", "--device", "sim-rknpu", "-n", "8"],
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=1700, env=tool_env())
    out = proc.stdout
    assert proc.returncode == 0, out[-3000:]
    lines = out.replace("\r", "\n").splitlines()
    bars = [line for line in lines if "staging weights" in line]
    assert bars and all(line.startswith("staging weights (fp16)") for line in bars), bars
    # greedy continuation of "The capital of France is" (CPU: "the capital of the country of France.")
    text = [line for line in lines if "The capital of France is" in line]
    assert text and text[-1].startswith("The capital of France is the capital of"), text
    # placement auto: the demo says where the prompt's and the decode's weight matmuls ran
    assert "demo: where the weight matmuls ran (placement auto" in out, out[-3000:]
    assert "demo:   decode: " in out and "weight matmuls on the" in out, out[-3000:]
