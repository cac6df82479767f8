"""``llama-server --rpc`` through ``rknpu serve`` with the pinned llama.cpp's speculative heads:
EAGLE-3 (``--spec-type draft-eagle3 -md HEAD``), MTP (``draft-mtp``, the target's own next-token
layer), DFlash (``draft-dflash``) and DSpark (``draft-dspark``).

What must hold, for each head, through the simulated NPU and through ``--device host``: at
temperature 0 the speculative answer is the same text as the plain answer of the same target;
drafts were accepted (llama-server's ``timings.draft_n_accepted`` > 0) and rejected (the
rejected rows roll the target's KV cache back on the device); and, on the NPU, the target's
verification passes ran as NPU matmuls with M = n_draft + 1 rows (``--stats-json``
``npu_matmuls_by_m``, beyond those of the plain run). Also EAGLE-3's reduced draft vocabulary
(``d2t``) and two sequences speculating at once (``-np 2``).

Models: tests/support/spec_heads.py (a bigram-dominated tiny target and heads derived from its
weights, so acceptance is by construction, not by luck). The EAGLE-3, DFlash and DSpark heads
run on the client's CPU (``-devd none``), so every matmul the server counts is the target's;
the MTP layer is part of the target and runs on the server.
"""

from __future__ import annotations

import concurrent.futures
from pathlib import Path

import pytest

from support.e2e_support import llama_server, rknpu_server, tool_or_skip
from support.spec_heads import Target, TargetConfig, write_dflash, write_eagle3, write_target

pytestmark = [pytest.mark.llama]
N_DRAFT = 4
MAX_TOKENS = 24
NO_WARMUP = ("--no-warmup",)   # the warm-up decodes 2 tokens, which would look like a 2-row batch
CHATS = ("The capital of France is", "Paris is the city of")
# OUR CHOICE: the layers' share of the target (wo, ffn_down at 3% of the other weights): the
# target follows its bigram most of the time, so drafts are both accepted and rejected (measured
# on this box, 32 tokens, CPU-only: 23/30 EAGLE-3, 13/66 DFlash, 23/28 DSpark, 21/36 MTP; at 0
# every EAGLE-3, DSpark and MTP draft is accepted)
CONFIG = TargetConfig(layer_scale=0.03)
TARGET_MATMULS = 7 * CONFIG.n_layer + 1   # q, k, v, o, gate, up, down per layer and the output head


class Heads:
    def __init__(self, root: Path):
        self.target: Target = write_target(root / "tiny-bigram-llama.gguf", config=CONFIG)
        self.target_mtp: Target = write_target(root / "tiny-bigram-hy_v3-mtp.gguf", mtp=True, config=CONFIG)
        self.files = {"eagle3": write_eagle3(root / "tiny-eagle3.gguf", self.target),
                      "eagle3-d2t": write_eagle3(root / "tiny-eagle3-d2t.gguf", self.target, d2t=True),
                      "dflash": write_dflash(root / "tiny-dflash.gguf", self.target),
                      "dspark": write_dflash(root / "tiny-dspark.gguf", self.target, dspark=True)}

    def model(self, head: str) -> Path:
        return self.target_mtp.path if head == "mtp" else self.target.path

    def spec_args(self, head: str) -> tuple[str, ...]:
        common = ("--spec-draft-n-max", str(N_DRAFT))
        if head == "mtp":
            return ("--spec-type", "draft-mtp", *common)
        kind = "draft-eagle3" if head.startswith("eagle3") else f"draft-{head}"
        # a head that inherits the target's output head must run where that tensor lives (-devd none aborts:
        # "pre-allocated tensor (output.weight) in a buffer (RPC0) that cannot run the operation")
        placement = () if head == "eagle3" else ("-devd", "none", "-ngld", "0")
        return ("--spec-type", kind, "-md", str(self.files[head]), *placement, *common)


@pytest.fixture(scope="module")
def heads(tmp_path_factory: pytest.TempPathFactory) -> Heads:
    tool_or_skip("llama-server")
    return Heads(tmp_path_factory.mktemp("spec-heads"))


def chat(server, content: str) -> dict:
    return server.post("/v1/chat/completions", {
        "messages": [{"role": "user", "content": content}], "temperature": 0.0, "max_tokens": MAX_TOKENS,
        "seed": 1, "ignore_eos": True})


def answer(reply: dict) -> str:
    return reply["choices"][0]["message"]["content"]


def rows_by_m(stats: dict) -> dict[int, int]:
    return {int(m): n for m, n in stats.get("npu_matmuls_by_m", {}).items()}


RUNS = [*[(head, "sim-rknpu") for head in ("eagle3", "eagle3-d2t", "mtp", "dflash", "dspark")],
        *[(head, "host") for head in ("eagle3", "mtp", "dflash", "dspark")]]


@pytest.mark.timeout(900)
@pytest.mark.parametrize(("head", "device"), RUNS, ids=[f"{h}-{d}" for h, d in RUNS])
def test_head_drafts_are_accepted_and_verified_on_the_device(tmp_path: Path, heads: Heads, head: str,
                                                             device: str) -> None:
    extra = ("--weights", "fp16") if device != "host" else ()
    model = heads.model(head)
    with rknpu_server(tmp_path, device=device, extra=extra) as server:
        with llama_server(tmp_path, model, rpc=server.endpoint, extra=NO_WARMUP) as plain_client:
            plain = chat(plain_client, CHATS[0])
        plain_by_m = rows_by_m(server.first_stats())
        with llama_server(tmp_path, model, rpc=server.endpoint, extra=(*NO_WARMUP, *heads.spec_args(head))) as client:
            speculative = chat(client, CHATS[0])
            log = client.log_path.read_text(errors="replace")
        assert server.alive(), server.log()
    timings = speculative["timings"]
    assert answer(plain).strip(), plain
    assert answer(speculative) == answer(plain), f"speculative {answer(speculative)!r} != plain {answer(plain)!r}"
    assert 0 < timings.get("draft_n_accepted", 0) < timings.get("draft_n", 0), f"{timings}\n{log[-3000:]}"
    assert server.nodes("MUL_MAT") > 0, "no matmul reached the server"
    if head == "eagle3-d2t":
        # llama.cpp sizes the head's output by d2t (load fails on any other shape): the drafts came
        # from a vocabulary of len(d2t) tokens, mapped to target ids in the graph
        from gguf import GGUFReader

        tensors = {t.name: t for t in GGUFReader(heads.files[head]).tensors}
        n_draft = int(tensors["d2t"].shape[0])
        assert n_draft < heads.target.embd.shape[0] and int(tensors["output.weight"].shape[1]) == n_draft
    if device == "host":
        return
    by_m = rows_by_m(server.stats())
    # a verification pass runs every matmul weight of the target once at M = N_DRAFT + 1 (a head on the
    # device adds its own, on the same rows: those batches follow the target's, never replace them)
    verified = by_m.get(N_DRAFT + 1, 0) - plain_by_m.get(N_DRAFT + 1, 0)
    assert verified >= TARGET_MATMULS, f"no {N_DRAFT + 1}-row verification on the NPU: plain {plain_by_m}, after {by_m}"


@pytest.mark.timeout(900)
@pytest.mark.parametrize("head", ["eagle3", "mtp"])
def test_two_sequences_speculate_at_once_through_the_npu(tmp_path: Path, heads: Heads, head: str) -> None:
    """``-np 2``, two chats at once with the head: each answer is the same server's plain answer
    to that chat, both drafted and had drafts accepted, and verification passes carrying both
    sequences' drafts (more than N_DRAFT + 1 rows) ran on the NPU."""
    slots = (*NO_WARMUP, "-np", "2", "-c", "1024")
    model = heads.model(head)
    with rknpu_server(tmp_path, extra=("--weights", "fp16")) as server:
        with llama_server(tmp_path, model, rpc=server.endpoint, extra=slots) as plain_client:
            plain = [answer(chat(plain_client, c)) for c in CHATS]
        plain_by_m = rows_by_m(server.first_stats())
        with llama_server(tmp_path, model, rpc=server.endpoint, extra=(*slots, *heads.spec_args(head))) as client:
            with concurrent.futures.ThreadPoolExecutor(len(CHATS)) as pool:
                replies = list(pool.map(lambda c: chat(client, c), CHATS))
            log = client.log()
    for content, reply, expected in zip(CHATS, replies, plain):
        assert answer(reply) == expected, f"{content!r}: {answer(reply)!r} != {expected!r}"
        assert reply["timings"].get("draft_n_accepted", 0) > 0, f"{reply['timings']}\n{log}"
    by_m = rows_by_m(server.stats())
    both = {m: n - plain_by_m.get(m, 0) for m, n in by_m.items() if N_DRAFT + 1 < m <= 2 * (N_DRAFT + 1)}
    assert any(n > 0 for n in both.values()), f"no two-sequence verification pass: plain {plain_by_m}, after {by_m}"


@pytest.mark.timeout(300)
def test_eagle3_without_spec_type_does_not_speculate(tmp_path: Path, heads: Heads) -> None:
    """The user's trap (docs/speculative.md, "The recipe"): ``-md`` with an EAGLE-3 head and no
    ``--spec-type`` loads the head and never drafts; a DFlash head is detected from its metadata."""
    def drafted(extra: tuple[str, ...]) -> dict:
        with llama_server(tmp_path, heads.target.path, rpc=None, extra=(*NO_WARMUP, *extra)) as client:
            reply = chat(client, CHATS[0])
            log = client.log()
        assert "loading draft model" in log, log
        return reply["timings"]
    assert "draft_n" not in drafted(("-md", str(heads.files["eagle3"]))), "EAGLE-3 speculated without --spec-type"
    assert drafted(("-md", str(heads.files["dflash"]))).get("draft_n", 0) > 0
