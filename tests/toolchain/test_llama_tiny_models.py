"""The tiny GGUF helper writes files that gguf reads back and the pinned llama.cpp runs on the CPU."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from gguf import GGUFReader

from support.e2e_support import completion, tool_or_skip
from support.gguf_models import ARCHES, TinyConfig, tiny_vocab, write_tiny_gguf


def test_vocab_is_unique_with_byte_fallback() -> None:
    tokens, scores, types = tiny_vocab()
    assert len(set(tokens)) == len(tokens) == len(scores) == len(types)
    assert sum(1 for t in tokens if t.startswith("<0x")) == 256


@pytest.mark.parametrize("arch", ARCHES)
def test_written_tensors_match_family(tmp_path: Path, arch: str) -> None:
    path = write_tiny_gguf(tmp_path / f"{arch}.gguf", arch, "q8_0", config=TinyConfig(n_layer=1))
    reader = GGUFReader(path)
    names = {t.name for t in reader.tensors}
    assert ("blk.0.attn_q.bias" in names) == (arch == "qwen2")
    assert ("blk.0.attn_q_norm.weight" in names) == (arch == "qwen3")
    q = next(t for t in reader.tensors if t.name == "blk.0.attn_q.weight")
    assert q.tensor_type.name == "Q8_0" and list(q.shape) == [256, 256]
    arch_field = reader.fields["general.architecture"]
    assert bytes(arch_field.parts[-1]).decode() == arch


def test_same_seed_same_file(tmp_path: Path) -> None:
    a = write_tiny_gguf(tmp_path / "a.gguf", "llama", seed=3).read_bytes()
    b = write_tiny_gguf(tmp_path / "b.gguf", "llama", seed=3).read_bytes()
    c = write_tiny_gguf(tmp_path / "c.gguf", "llama", seed=4).read_bytes()
    assert a == b and a != c


def test_bad_arguments_are_rejected(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="arch"):
        write_tiny_gguf(tmp_path / "x.gguf", "gpt2")
    with pytest.raises(ValueError, match="wtype"):
        write_tiny_gguf(tmp_path / "x.gguf", "llama", "iq4_nl")


@pytest.mark.llama
@pytest.mark.timeout(300)
@pytest.mark.parametrize("arch,wtype", [("llama", "f16"), ("qwen2", "f16"), ("qwen3", "f16"), ("llama", "q8_0")])
def test_llama_cpp_runs_tiny_model_on_cpu(tmp_path: Path, arch: str, wtype: str) -> None:
    tool_or_skip("llama-completion")
    model = write_tiny_gguf(tmp_path / f"tiny-{arch}-{wtype}.gguf", arch, wtype)
    text, proc = completion(model, "The capital of France is", n_predict=8)
    assert proc.returncode == 0, proc.stderr[-3000:]
    # 8 tokens generated: the prompt's batch samples the first, then 7 single-token decodes
    assert re.search(r" eval time =.*/\s+7 runs", proc.stderr), proc.stderr[-3000:]
    assert text, proc.stderr[-3000:]
