"""Weight and activation conversion for the NPU (fp16 rounding, per-row int8 quantisation)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays

from ggml_rknpu.engine.staging import (
    dequantize_output,
    quantize_rows_int8,
    stage_activation,
    stage_weight,
)

rng = np.random.default_rng(7)


def test_fp16_weight_is_round_to_nearest_even():
    b = np.array([[1 + 2**-11, 1 + 3 * 2**-11, -2.0, 0.1]], dtype=np.float32)
    w = stage_weight(b, "fp16")
    assert w.data.dtype == np.float16 and w.scales is None
    assert w.data[0, 0] == np.float16(1.0)           # tie -> even
    assert w.data[0, 1] == np.float16(1 + 2**-9)     # tie -> even (upwards)
    assert w.data[0, 3] == np.float16(0.1)


def test_fp16_weight_from_int8_is_exact():
    b = rng.integers(-128, 128, size=(5, 7), dtype=np.int8)
    assert np.array_equal(stage_weight(b, "fp16").data, b.astype(np.float16))


def test_fp16_overflow_is_refused():
    with pytest.raises(ValueError, match="fp16 range"):
        stage_weight(np.array([[70000.0]]), "fp16")


def test_nan_is_refused():
    with pytest.raises(ValueError, match="NaN"):
        stage_weight(np.array([[1.0, np.nan]]), "int8")


def test_int8_weight_kept_as_is():
    b = rng.integers(-128, 128, size=(4, 9), dtype=np.int8)
    w = stage_weight(b, "int8")
    assert w.scales is None and np.array_equal(w.data, b)


def test_float_weight_quantised_per_row():
    b = rng.standard_normal((6, 33)).astype(np.float32) * np.arange(1, 7)[:, None]
    b[2] = 0.0
    w = stage_weight(b, "int8")
    assert w.scales is not None
    assert w.data.dtype == np.int8 and w.scales.shape == (6,)
    assert np.abs(w.data).max() == 127
    assert w.scales[2] == 1.0 and not w.data[2].any()
    err = np.abs(w.data * w.scales[:, None] - b)
    assert (err <= w.scales[:, None] / 2 + 1e-6).all()      # within half a step


@pytest.mark.parametrize("b, dtype, exc", [
    (np.zeros((2, 2), np.int32), "int8", TypeError),
    (np.zeros((2, 2), np.float32), "bf16", ValueError),
    (np.zeros((2,), np.float32), "fp16", ValueError),
    (np.zeros((0, 3), np.float32), "fp16", ValueError),
    ([[1.0]], "fp16", TypeError),
])
def test_bad_weights_are_clear_errors(b, dtype, exc):
    with pytest.raises(exc):
        stage_weight(b, dtype)


def test_activation_follows_the_weight_format():
    a = rng.standard_normal((3, 8)).astype(np.float32)
    w16 = stage_weight(rng.standard_normal((4, 8)), "fp16")
    assert stage_activation(a, w16).data.dtype == np.float16
    w8 = stage_weight(rng.integers(-5, 5, (4, 8), dtype=np.int8), "int8")
    a8 = rng.integers(-128, 128, (3, 8), dtype=np.int8)
    act = stage_activation(a8, w8)
    assert act.scales is None and np.array_equal(act.data, a8)
    act = stage_activation(a, w8)
    assert act.data.dtype == np.int8 and act.scales is not None and act.scales.shape == (3,)


def test_dequantize_output_applies_both_scales():
    a = rng.standard_normal((3, 40)).astype(np.float32)
    b = rng.standard_normal((5, 40)).astype(np.float32)
    w = stage_weight(b, "int8")
    act = stage_activation(a, w)
    c32 = act.data.astype(np.int32) @ w.data.astype(np.int32).T
    c = dequantize_output(c32, act, w)
    assert c.dtype == np.float32
    np.testing.assert_allclose(c, a @ b.T, atol=0.05 * np.abs(a).sum(1).max())
    exact = dequantize_output(c32, stage_activation(act.data, stage_weight(w.data, "int8")),
                              stage_weight(w.data, "int8"))
    assert exact.dtype == np.int32 and np.array_equal(exact, c32)


@settings(max_examples=40, deadline=None)
@given(arrays(np.float32, st.tuples(st.integers(1, 6), st.integers(1, 20)),
              elements=st.floats(-1e4, 1e4, width=32)))
def test_quantisation_error_is_at_most_half_a_step(x):
    q, scale = quantize_rows_int8(x, "x")
    assert (np.abs(q.astype(np.float64) * scale[:, None] - x) <= scale[:, None] * 0.5 * (1 + 1e-5)).all()


def test_a_row_of_subnormal_values_quantises_within_half_a_step():
    x = np.array([[1e-45, -1e-45, 0.0], [3e-39, 1e-40, -2e-39]], np.float32)   # peak/127 subnormal
    q, scale = quantize_rows_int8(x, "x")
    assert (scale > 0).all() and np.isfinite(scale).all()
    assert (np.abs(q.astype(np.float64) * scale[:, None] - x) <= scale[:, None] * 0.5).all()
