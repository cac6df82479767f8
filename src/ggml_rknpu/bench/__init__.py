"""Rig check, matmul and model benchmarks, reports with plots, the board selftest."""
