"""Resident weights and matmul through the real submit path (the public API)."""

from ggml_rknpu.engine.api import NpuEngine, open_engine
from ggml_rknpu.engine.core_files import open_npu
from ggml_rknpu.engine.npu_weight import FusedWeight, Weight
from ggml_rknpu.engine.programs import m_bucket
from ggml_rknpu.engine.timing import Timing

__all__ = ["FusedWeight", "NpuEngine", "Timing", "Weight", "m_bucket", "open_engine", "open_npu"]
