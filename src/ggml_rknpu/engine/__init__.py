"""Resident weights and matmul through the real submit path (the public API)."""
