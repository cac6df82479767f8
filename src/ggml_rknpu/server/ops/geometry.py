"""ggml's shape and stride predicates, on the wire's tensor descriptions.

Each function is the Python twin of the ggml.c function of the same name (pinned llama.cpp
0c1e570); ``tests/server/ops/test_ops_rules.py`` checks every one against the exported C function of the
loaded library on random geometries, so a twin that drifts from ggml fails CI.
"""

from __future__ import annotations

from typing import Protocol

from ggml_rknpu.libggml.enums import TYPE_TRAITS, GgmlType
from ggml_rknpu.server.ops.vocabulary import tensor_span


class Geometry(Protocol):
    """What the predicates read of a tensor (read-only: the wire's tensors are frozen)."""

    @property
    def type(self) -> int: ...
    @property
    def ne(self) -> tuple[int, int, int, int]: ...
    @property
    def nb(self) -> tuple[int, int, int, int]: ...


def block_size(t: Geometry) -> int:
    return TYPE_TRAITS[GgmlType(t.type)][0]


def type_size(t: Geometry) -> int:
    return TYPE_TRAITS[GgmlType(t.type)][1]


def nelements(t: Geometry) -> int:
    return t.ne[0] * t.ne[1] * t.ne[2] * t.ne[3]


def nrows(t: Geometry) -> int:
    return t.ne[1] * t.ne[2] * t.ne[3]


def is_empty(t: Geometry) -> bool:
    return 0 in t.ne


def _contiguous_m_n(t: Geometry, m: int, n: int) -> bool:
    next_nb = type_size(t)
    if t.ne[0] != block_size(t) and t.nb[0] != next_nb:
        return False
    next_nb *= t.ne[0] // block_size(t)
    for i in range(1, n):
        if i > m:
            if t.ne[i] != 1 and t.nb[i] != next_nb:
                return False
            next_nb *= t.ne[i]
        else:
            next_nb = t.ne[i] * t.nb[i]
    return True


def is_contiguous(t: Geometry) -> bool:
    return _contiguous_m_n(t, 0, 4)


def is_contiguous_1(t: Geometry) -> bool:
    return _contiguous_m_n(t, 1, 4)


def is_contiguous_2(t: Geometry) -> bool:
    return _contiguous_m_n(t, 2, 4)


def is_contiguous_rows(t: Geometry) -> bool:
    return t.ne[0] == block_size(t) or t.nb[0] == type_size(t)


def is_padded_1d(t: Geometry) -> bool:
    return t.nb[0] == type_size(t) and t.nb[2] == t.nb[1] * t.ne[1] and t.nb[3] == t.nb[2] * t.ne[2]


def is_transposed(t: Geometry) -> bool:
    return t.nb[0] > t.nb[1]


def are_same_shape(a: Geometry, b: Geometry) -> bool:
    return tuple(a.ne) == tuple(b.ne)


def can_repeat(t0: Geometry, t1: Geometry) -> bool:
    if is_empty(t0):
        return is_empty(t1)
    return all(n1 % n0 == 0 for n0, n1 in zip(t0.ne, t1.ne))


def is_vector(t: Geometry) -> bool:
    return t.ne[1] == 1 and t.ne[2] == 1 and t.ne[3] == 1


def is_matrix(t: Geometry) -> bool:
    return t.ne[2] == 1 and t.ne[3] == 1


def is_3d(t: Geometry) -> bool:
    return t.ne[3] == 1


def is_scalar(t: Geometry) -> bool:
    return t.ne == (1, 1, 1, 1)


def contiguous_nb(type_: int, ne: tuple[int, ...]) -> tuple[int, int, int, int]:
    """The strides ggml_new_tensor gives a tensor of this type and shape."""
    block, size = TYPE_TRAITS[GgmlType(type_)]
    nb0 = size
    nb1 = nb0 * (ne[0] // block)
    return (nb0, nb1, nb1 * ne[1], nb1 * ne[1] * ne[2])


def span(t: Geometry) -> int:
    """ggml_nbytes: the bytes a tensor reaches from its data pointer (0 if empty)."""
    return tensor_span(t.type, t.ne, t.nb)


def covers_dense(t: Geometry) -> bool:
    """Its checked span holds at least the bytes of the same tensor laid out contiguously.

    Why the validator asks this of every tensor a kernel touches: a ggml kernel either
    follows ``nb`` (and stays inside ``ggml_nbytes``) or assumes a contiguous layout (and
    reads ``nelements * type_size`` bytes); with this property both stay inside the bytes
    the server has checked against the buffer."""
    return is_empty(t) or span(t) >= nelements(t) // block_size(t) * type_size(t)
