"""ggml's own log messages reach Python logging (``libggml.log``), not the process's stderr:
the line ggml-cpu logs for each weight it repacks is a debug record of ``ggml_rknpu.ggml``."""

from __future__ import annotations

import logging

import numpy as np
import pytest
from gguf import GGMLQuantizationType, quants

from ggml_rknpu.libggml import lib, repack
from ggml_rknpu.libggml.enums import GgmlType
from ggml_rknpu.libggml.log import GgmlLog

K, N = 256, 64


def test_a_repack_is_logged_at_debug_and_not_printed(caplog, capfd) -> None:
    g = lib.load()
    rng = np.random.default_rng(0)
    wq = quants.quantize(rng.standard_normal((N, K)).astype(np.float32), GGMLQuantizationType.Q4_0)
    with caplog.at_level(logging.DEBUG, logger="ggml_rknpu.ggml"):
        copy = repack.repack(g, int(GgmlType.Q4_0), K, N, np.frombuffer(wq.tobytes(), dtype=np.uint8).copy(), "w")
    if copy is None:
        pytest.skip("ggml-cpu repacks no Q4_0 layout on this CPU")
    copy.close()
    records = [r for r in caplog.records if r.name == "ggml_rknpu.ggml" and "repack tensor w" in r.getMessage()]
    assert records and all(r.levelno == logging.DEBUG for r in records), caplog.text
    assert "repack tensor" not in capfd.readouterr().err


def test_levels_and_continuations(caplog) -> None:
    log = GgmlLog()
    with caplog.at_level(logging.DEBUG, logger="ggml_rknpu.ggml"):
        log._emit(3, b"a warning\n", None)
        log._emit(5, b"its continuation\n", None)      # GGML_LOG_LEVEL_CONT keeps the level
        log._emit(1, b"a debug line\n", None)
        log._emit(4, None, None)                       # nothing to say: no record
    assert [(r.levelno, r.getMessage()) for r in caplog.records] == [
        (logging.WARNING, "a warning"), (logging.WARNING, "its continuation"), (logging.DEBUG, "a debug line")]
