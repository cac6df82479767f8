"""Resident weights and matmul through the real submit path (the public API)."""

from ggml_rknpu.engine.api import FusedWeight, Npu, Timing, Weight, m_bucket, open_engine

__all__ = ["FusedWeight", "Npu", "Timing", "Weight", "m_bucket", "open_engine"]
