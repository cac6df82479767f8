"""Greedy answers of two llama-servers compared token by token, allowing only near-ties to differ.

Why not plain string equality: with ``-np N`` continuous batching, which rows share a pass
(prompt batches of several slots, decode passes of 1..N rows) depends on when requests arrive,
and neither ggml-cpu nor the NPU gives a row the same rounding at every batch composition.
Measured on the tiny random llama (docs/speculative.md, "Tests"): the chosen token's logprob
moves by up to ~0.005 nats between compositions on the CPU-only server itself and by up to
~0.02 between the simulated NPU and the CPU. A greedy choice whose top-2 margin is below that
is a coin toss on either server; everywhere else the tokens must be equal.

The rule (``agree``): walk both answers; where the tokens are equal their logprobs must be
within ``close`` (tokens llama-server gives no logprobs for must be equal, full stop); at the
first position where they differ, each server's choice must be within ``tie`` of the other's
top among the other's reported candidates (asked with more than two, a tie of three tokens
counts too), and the comparison of that answer stops there (the contexts differ from then on).
Anything else is a wrong token: a row of another slot, a stale output, padding leaking into a
row all move logprobs by far more.
"""

from __future__ import annotations

from dataclasses import dataclass

TIE = 0.1     # nats: a top-2 margin below this is a near-tie (5x the largest shift measured)
CLOSE = 0.1   # nats: the same token's logprob on two servers (largest difference measured 0.02)


@dataclass(frozen=True)
class Choice:
    """One generated token: the greedy choice, its logprob, and the runner-up's. ``hidden``: the
    bytes of the tokens just before it that llama-server reports no logprobs for (a token that
    leaves the text in the middle of a UTF-8 character is folded into the next entry; random
    models emit many byte tokens)."""
    token: int
    logprob: float
    runner_up: int
    runner_up_logprob: float
    hidden: bytes = b""
    others: tuple[tuple[int, float], ...] = ()    # (token, logprob) of the candidates after the runner-up

    @property
    def margin(self) -> float:
        return self.logprob - self.runner_up_logprob

    def behind(self, token: int) -> float | None:
        """How far ``token``'s logprob is below the choice's, if the server reported it."""
        if token == self.runner_up:
            return self.margin
        return next((self.logprob - lp for t, lp in self.others if t == token), None)


@dataclass(frozen=True)
class Agreement:
    compared: int               # positions whose tokens were equal (and logprobs close)
    near_tie_at: int | None     # where the answers parted at a near-tie, if they did


def choices(entries: list[dict]) -> list[Choice]:
    """Choices from llama-server's per-token entries: a chat reply's ``choices[0].logprobs.content``
    (asked with ``top_logprobs`` >= 2) or a ``/completion`` result's ``completion_probabilities``
    (``n_probs`` >= 2)."""
    out = []
    for entry in entries:
        first, second, *rest = entry["top_logprobs"]
        hidden = bytes(entry["bytes"][: len(entry["bytes"]) - len(first["bytes"])])
        others = tuple((e["id"], e["logprob"]) for e in rest)
        out.append(Choice(first["id"], first["logprob"], second["id"], second["logprob"], hidden, others))
    return out


def agree(device: list[Choice], reference: list[Choice], *, tie: float = TIE, close: float = CLOSE,
          what: str = "answer") -> Agreement:
    """Raise AssertionError unless ``device`` equals ``reference`` up to a shared near-tie."""
    for i, (d, r) in enumerate(zip(device, reference)):
        assert d.hidden == r.hidden, (
            f"{what}, token {i}: the tokens before it differ ({d.hidden!r} vs {r.hidden!r}) where llama-server "
            "reports no logprobs, so a near-tie cannot be told from a wrong token")
        if d.token == r.token:
            assert abs(d.logprob - r.logprob) <= close, (
                f"{what}, token {i}: same token {d.token} but logprob {d.logprob:.4f} vs {r.logprob:.4f} "
                f"(more than {close} apart)")
            continue
        r_behind, d_behind = d.behind(r.token), r.behind(d.token)
        assert r_behind is not None and d_behind is not None and r_behind < tie and d_behind < tie, (
            f"{what}, token {i}: device chose {d.token} (margin {d.margin:.4f} over {d.runner_up}), reference "
            f"chose {r.token} (margin {r.margin:.4f} over {r.runner_up}): not a near-tie between the two")
        return Agreement(i, i)
    assert len(device) == len(reference), f"{what}: {len(device)} tokens vs {len(reference)}"
    return Agreement(len(device), None)
