"""The near-tie rule the concurrent-slot tests compare answers by (tests/support/greedy.py) fails
on what a serving bug produces and passes only on a shared near-tie."""

from __future__ import annotations

import pytest

from support.greedy import Choice, agree, choices

REFERENCE = [Choice(7, -0.1, 9, -2.5), Choice(3, -0.69, 4, -0.70), Choice(5, -0.3, 6, -1.9)]


def test_equal_answers_agree_everywhere() -> None:
    device = [Choice(7, -0.101, 9, -2.49), Choice(3, -0.695, 4, -0.698), Choice(5, -0.31, 6, -1.9)]
    result = agree(device, REFERENCE)
    assert (result.compared, result.near_tie_at) == (3, None)


def test_a_flip_at_a_shared_near_tie_stops_the_comparison_there() -> None:
    device = [Choice(7, -0.1, 9, -2.5), Choice(4, -0.69, 3, -0.695), Choice(8, -0.2, 5, -3.0)]
    result = agree(device, REFERENCE)
    assert (result.compared, result.near_tie_at) == (1, 1)


@pytest.mark.parametrize("device, why", [
    ([Choice(9, -0.1, 7, -2.5), *REFERENCE[1:]], "not a near-tie"),              # a wide-margin token differs
    ([REFERENCE[0], Choice(8, -0.69, 3, -0.70), REFERENCE[2]], "not a near-tie"),  # a third token at a tie
    ([REFERENCE[0], REFERENCE[1], Choice(5, -0.9, 6, -1.9)], "logprob"),           # right token, wrong values
    (REFERENCE[:2], "tokens vs"),                                                 # an answer cut short
    ([REFERENCE[0], Choice(3, -0.69, 4, -0.70, b"\xd5"), REFERENCE[2]], "no logprobs"),  # a token without logprobs
])
def test_what_a_serving_bug_produces_fails(device: list[Choice], why: str) -> None:
    with pytest.raises(AssertionError, match=why):
        agree(device, REFERENCE)


def test_a_flip_at_a_tie_of_three_passes_only_when_both_servers_report_it() -> None:
    """Asked for more candidates, a flip between two tokens of a three-way tie is a near-tie;
    a candidate further than ``tie`` behind, or not reported, is not."""
    ref = [Choice(3, -1.00, 4, -1.04, others=((8, -1.08),))]
    assert agree([Choice(8, -0.99, 5, -1.05, others=((3, -1.07),))], ref).near_tie_at == 0
    with pytest.raises(AssertionError, match="not a near-tie"):
        agree([Choice(8, -0.99, 5, -1.05, others=((3, -1.5),))], ref)
    with pytest.raises(AssertionError, match="not a near-tie"):
        agree([Choice(8, -0.99, 5, -1.05)], ref)


def test_choices_read_llama_servers_token_entries() -> None:
    whole = {"id": 7, "bytes": [97], "top_logprobs": [{"id": 7, "logprob": -0.1, "bytes": [97]},
                                                      {"id": 9, "logprob": -2.5, "bytes": [98]}]}
    folded = {"id": 257, "bytes": [213, 254], "top_logprobs": [{"id": 257, "logprob": -0.08, "bytes": [254]},
                                                               {"id": 135, "logprob": -2.68, "bytes": [132]}]}
    assert choices([whole, folded]) == [Choice(7, -0.1, 9, -2.5), Choice(257, -0.08, 135, -2.68, b"\xd5")]
