"""What the rule tests share: every node of support.ggml_builders, as ggml's builders made it."""

from __future__ import annotations

import pytest

from support.ggml_builders import Scratch, _made_by_ggml


@pytest.fixture(scope="module")
def built(host_ggml):
    """label -> (node, sources) for every builder node of support.ggml_builders._made_by_ggml."""
    sc = Scratch(host_ggml)
    nodes = {label: sc.node(t) for label, t in _made_by_ggml(sc)}
    sc.close()
    return nodes
