"""Nodes the client did not flag GGML_TENSOR_FLAG_COMPUTE are not run.

llama.cpp's ``ggml_build_forward_select`` puts every alternative branch into the graph and
sets the COMPUTE flag only on the chosen one; ggml-cpu under the C++ ``ggml-rpc-server``
skips the rest. From b11434 on, gemma3's input embedding is such a select: token rows
(GET_ROWS), vector embeddings, or a mixed batch (SET_ROWS of token rows into a copy of the
embeddings, indexed by ``inp_mixed_slots``). For a text prompt the client fills only the
token branch's inputs; the mixed branch's index tensor holds whatever the buffer held. These
graphs are built here exactly that way, with crafted messages, and run through the real host
ops.
"""

from __future__ import annotations

import struct

import numpy as np
import pytest

from ggml_rknpu.libggml.enums import GgmlOp, GgmlTensorFlag, GgmlType
from support.rpc_testkit import T, serve

pytestmark = pytest.mark.timeout(60)
N_EMBD, VOCAB, N_TOK = 8, 16, 6
SCALE = 2.5
INPUT, COMPUTE = int(GgmlTensorFlag.INPUT), int(GgmlTensorFlag.COMPUTE)
# Stale bytes of a never-written index tensor, as the issue saw them (heap pointers, a count).
STALE_SLOTS = (94111623641616, 6, 195544087047384, 0, 94111623641616, 0)


class EmbeddingSelect:
    """The b11434 ``build_inp_embd`` graph: branch 0 tokens, branch 2 mixed, then a SCALE."""

    def __init__(self, c, selected: int, n_mixed: int = N_TOK) -> None:
        self.c = c
        wh, wb = c.alloc_base(1 << 14)
        ch, cb = c.alloc_base(1 << 14)
        at = iter(range(cb, cb + (1 << 14), 512))

        def f32(*ne, **kw) -> T:
            return T(ne=(*ne, 1, 1), buffer=ch, data=next(at), **kw)

        def idx(type_: GgmlType, n: int, name: str) -> T:
            return T(ne=(n, 1, 1, 1), buffer=ch, data=next(at), type=int(type_), flags=INPUT, name=name)

        def node(branch: int | None, op: GgmlOp, *src: T, rows: int = N_TOK, **kw) -> T:
            flags = COMPUTE if branch in (None, selected) else 0
            return f32(N_EMBD, rows, op=int(op), src=tuple(s.id for s in src), flags=flags, **kw)

        self.tok_embd = T(ne=(N_EMBD, VOCAB, 1, 1), buffer=wh, data=wb, name="token_embd.weight")
        self.tokens = idx(GgmlType.I32, N_TOK, "inp_tokens")
        self.mixed_tokens = idx(GgmlType.I32, n_mixed, "inp_mixed_tokens")
        self.mixed_slots = idx(GgmlType.I64, n_mixed, "inp_mixed_slots")
        self.mixed_embd = f32(N_EMBD, N_TOK, flags=INPUT, name="inp_mixed_embd")
        rows = node(0, GgmlOp.GET_ROWS, self.tok_embd, self.tokens)
        mixed_rows = node(2, GgmlOp.GET_ROWS, self.tok_embd, self.mixed_tokens, rows=n_mixed)
        dup = node(2, GgmlOp.DUP, self.mixed_embd)
        # ggml_set_rows(a, b, c) is a view of a with src = (b, c, a)
        set_rows = T(ne=dup.ne, buffer=ch, data=dup.data, op=int(GgmlOp.SET_ROWS),
                     src=(mixed_rows.id, self.mixed_slots.id, dup.id), view_src=dup.id,
                     flags=COMPUTE if selected == 2 else 0)
        chosen = rows if selected == 0 else set_rows
        self.dup = dup
        self.out = node(None, GgmlOp.SCALE, chosen, op_params=(_f32_bits(SCALE), 0), name="embd")
        self.nodes = [rows, mixed_rows, dup, set_rows, self.out]
        self.tensors = [self.tok_embd, self.tokens, self.mixed_tokens, self.mixed_slots, self.mixed_embd,
                        *self.nodes]

    def compute(self) -> np.ndarray:
        self.c.graph_compute(self.nodes, self.tensors)
        return self.c.get_array(self.out)


def _f32_bits(x: float) -> int:
    return struct.unpack("<i", struct.pack("<f", x))[0]


def _embedding() -> np.ndarray:
    return np.random.default_rng(16).standard_normal((VOCAB, N_EMBD)).astype(np.float32)


def test_unselected_branch_with_stale_indices_is_not_run() -> None:
    tokens = np.array([2, 9, 4, 4, 15, 0], dtype=np.int32)
    emb = _embedding()
    with serve() as st:
        with st.client() as c:
            g = EmbeddingSelect(c, selected=0)
            c.set_array(g.tok_embd, emb)
            c.set_array(g.tokens, tokens)
            c.set_array(g.mixed_tokens, np.zeros(N_TOK, dtype=np.int32))   # stale but in range
            c.set_array(g.mixed_slots, np.array(STALE_SLOTS, dtype=np.int64))
            c.set_array(g.dup, np.full((N_TOK, N_EMBD), 7.0, dtype=np.float32))
            np.testing.assert_array_equal(g.compute(), emb[tokens] * np.float32(SCALE))
            # the skipped SET_ROWS/DUP wrote nothing, and the connection is still served
            np.testing.assert_array_equal(c.get_array(g.dup), np.full((N_TOK, N_EMBD), 7.0, dtype=np.float32))
            c.graph_recompute()
            np.testing.assert_array_equal(c.get_array(g.out), emb[tokens] * np.float32(SCALE))
        assert st.state.stats.rejected == 0


def test_selected_mixed_branch_runs_its_set_rows() -> None:
    """The same graph with the mixed branch chosen: the flags, not the op, decide what runs."""
    emb = _embedding()
    vectors = np.random.default_rng(17).standard_normal((N_TOK, N_EMBD)).astype(np.float32)
    tok_ids = np.array([3, 11, 5], dtype=np.int32)
    slots = np.array([0, 2, 5], dtype=np.int64)
    with serve() as st:
        with st.client() as c:
            g = EmbeddingSelect(c, selected=2, n_mixed=len(slots))
            c.set_array(g.tok_embd, emb)
            c.set_array(g.tokens, np.full(N_TOK, 10 ** 6, dtype=np.int32))   # stale: out of range
            c.set_array(g.mixed_tokens, tok_ids)
            c.set_array(g.mixed_slots, slots)
            c.set_array(g.mixed_embd, vectors)
            expect = vectors.copy()
            expect[slots] = emb[tok_ids]
            np.testing.assert_array_equal(g.compute(), expect * np.float32(SCALE))
        assert st.state.stats.rejected == 0
