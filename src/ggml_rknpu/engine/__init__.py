"""Resident weights and matmul through the real submit path (the public API)."""

from ggml_rknpu.engine.api import Npu, Timing, Weight, m_bucket, open_engine

__all__ = ["Npu", "Timing", "Weight", "m_bucket", "open_engine"]
