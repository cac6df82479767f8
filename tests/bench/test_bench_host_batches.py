"""``rknpu bench host-batches``: each prompt size's rate is llama-bench's own mean for it,
generation tests left out."""

from __future__ import annotations

import json

from ggml_rknpu.bench.host_batches import bench_rates


def test_rates_are_llama_bench_means_per_prompt_size():
    out = json.dumps([{"n_prompt": 1, "n_gen": 0, "avg_ts": 105.2}, {"n_prompt": 4, "n_gen": 0, "avg_ts": 290.5},
                      {"n_prompt": 0, "n_gen": 16, "avg_ts": 80.0}])
    assert bench_rates(out) == {1: 105.2, 4: 290.5}
