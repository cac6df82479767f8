"""The llama.cpp b11739 client (protocol 8.0.0) in tests: ``toolchain.llamacpp_wheel`` makes the
``llama-cpp-py-sync==0.11739`` wheel load here (glibc < 2.38: its four C23 symbols, docs/ggml-rpc.md
P17); this module drives it in a subprocess (a greedy run with every token's top-2 log-probabilities,
for the near-tie rule) and runs its bundled C++ 8.0.0 server as the reference.
"""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from ggml_rknpu.toolchain.launch import free_port
from ggml_rknpu.toolchain.llamacpp_wheel import PACKAGE, SERVER_SCRIPT, Client, WheelUnavailable, client
from support.e2e_support import Server
from support.greedy import Choice

__all__ = ["PACKAGE", "Client", "WheelUnavailable", "client", "greedy", "cpp_server"]

# --- the driver that runs inside the subprocess ---------------------------------------------
_GREEDY = r"""
import json, sys
import numpy as np
from llama_cpp_py_sync import Llama
args = json.loads(sys.argv[1])
kw = dict(n_ctx=args["n_ctx"], n_batch=args["n_ctx"], n_threads=1, n_threads_batch=1, seed=1, verbose=False)
if args["rpc"]:
    kw.update(rpc_servers=args["rpc"], n_gpu_layers=99)
    if args.get("split_mode"):
        kw["split_mode"] = args["split_mode"]
if args.get("flash_attn") is not None:
    kw["flash_attn_type"] = args["flash_attn"]
llm = Llama(args["model"], **kw)
lib, ffi = llm._lib, llm._ffi
tokens = llm.tokenize(args["prompt"], add_special=True)
n_past = llm._eval_tokens(tokens, 0)
choices = []
for _ in range(args["n_predict"]):
    logits = np.frombuffer(ffi.buffer(lib.llama_get_logits_ith(llm._ctx, -1), 4 * llm.n_vocab), np.float32)
    logp = logits.astype(np.float64) - np.logaddexp.reduce(logits.astype(np.float64))
    first, second = (int(i) for i in np.argsort(-logp, kind="stable")[:2])
    choices.append([first, float(logp[first]), second, float(logp[second])])
    if llm.eos_token == first or lib.llama_vocab_is_eog(llm._vocab, first):
        break
    n_past = llm._eval_tokens([first], n_past)
text = llm.detokenize([s[0] for s in choices])
print("RESULT " + json.dumps({"choices": choices, "text": text}), flush=True)
llm.close()
"""


@dataclass(frozen=True)
class Greedy:
    choices: list[Choice]
    text: str


def greedy(c: Client, model: Path, prompt: str, n_predict: int, *, rpc: list[str] | None = None,
           n_ctx: int = 256, timeout: float = 600, split_mode: str | None = None,
           flash_attn: int | None = None) -> Greedy:
    """Greedy tokens of the b11739 client (CPU-only, or every layer over ``rpc``), with each token's
    top-2 logprobs for the near-tie rule (support.greedy)."""
    args = {"model": str(model), "prompt": prompt, "n_predict": n_predict, "rpc": rpc or [], "n_ctx": n_ctx,
            "split_mode": split_mode, "flash_attn": flash_attn}
    proc = subprocess.run([sys.executable, "-c", _GREEDY, json.dumps(args)], env=c.env(), capture_output=True,
                          text=True, timeout=timeout)
    line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")), None)
    if proc.returncode != 0 or line is None:
        raise AssertionError(f"b11739 client failed (exit {proc.returncode}):\n{proc.stdout[-3000:]}\n"
                             f"{proc.stderr[-6000:]}")
    out = json.loads(line[len("RESULT "):])
    return Greedy([Choice(t, lp, r, rlp) for t, lp, r, rlp in out["choices"]], out["text"])


class CppServer(Server):
    """The b11739 wheel's C++ 8.0.0 RPC server in a subprocess (prints ``Starting RPC server v8.0.0``)."""

    def __init__(self, c: Client, port: int, log_path: Path) -> None:
        super().__init__([sys.executable, "-c", SERVER_SCRIPT, f"127.0.0.1:{port}"], port, log_path, ready_timeout=60.0)
        self.client = c

    def env(self) -> dict[str, str]:
        return self.client.env()


def cpp_server(c: Client, tmp_path: Path) -> CppServer:
    port = free_port()
    return CppServer(c, port, tmp_path / f"b11739-rpc-server-{port}.log")

