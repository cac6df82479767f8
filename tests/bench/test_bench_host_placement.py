"""``rknpu bench host-placement``: llama-completion's decode rate is read from its own
eval-time line, never from the prompt's."""

from __future__ import annotations

import pytest

from ggml_rknpu.bench.host_placement import decode_tok_s

LOG = """llama_perf_sampler_print:    sampling time =       2.10 ms /    37 runs   (    0.06 ms per token)
common_perf_print: prompt eval time =     120.00 ms /     6 tokens (   20.00 ms per token,    50.00 tokens per second)
common_perf_print:        eval time =    1240.00 ms /    31 runs   (   40.00 ms per token,    25.00 tokens per second)
"""


def test_decode_rate_is_runs_over_eval_time():
    assert decode_tok_s(LOG) == pytest.approx(31 / 1.24)


def test_a_log_without_an_eval_line_is_an_error():
    with pytest.raises(RuntimeError, match="no eval time"):
        decode_tok_s(LOG.splitlines()[1])
