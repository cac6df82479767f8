"""Whole-unit arithmetic for sizes: how many units of ``b`` hold ``a`` (``ceil_div``) and
``a`` rounded up to a multiple of ``b`` (``align_up``). The NPU counts in atoms, kernel
groups, banks, fetch units and pages, so every layer rounds with these two and no other
(tests/package/test_alignment.py finds hand-rolled ones)."""

from __future__ import annotations


def ceil_div(a: int, b: int) -> int:
    """The least q with q * b >= a, for b > 0 (exact on ints of any size, unlike ceil(a / b))."""
    return -(-a // b)


def align_up(a: int, multiple: int) -> int:
    """The least multiple of ``multiple`` that is >= ``a``."""
    return ceil_div(a, multiple) * multiple
