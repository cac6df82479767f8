"""The vocabulary the validator's rule modules share (``rules``, ``rules_conv``, ``rules_training``).

A rule is a function of a :class:`Node` that raises :class:`Refused` with a reason (``need``)
or returns the node's index checks; these helpers state the common facts of ggml's builders:
the dst a builder makes (``dst_is``, ``like``), the type rows a ggml-cpu kernel implements
(``types_in``, ``is_type``). See ``rules`` for what a rule must establish and why.
"""

from __future__ import annotations

import struct
from collections.abc import Callable
from dataclasses import dataclass

from ggml_rknpu.hw.alignment import ceil_div
from ggml_rknpu.libggml import abi
from ggml_rknpu.libggml.enums import TYPE_TRAITS, GgmlType
from ggml_rknpu.server.ops import geometry as geo
from ggml_rknpu.server.ops.vocabulary import type_name
from ggml_rknpu.server.tensor import RpcTensor

F32, F16, BF16, I32, I64 = (int(t) for t in (GgmlType.F32, GgmlType.F16, GgmlType.BF16, GgmlType.I32, GgmlType.I64))
I8, I16 = int(GgmlType.I8), int(GgmlType.I16)
FLOAT = frozenset({F32, F16, BF16})
QUANTIZED = frozenset(int(t) for t, (block, _) in TYPE_TRAITS.items() if block > 1)
# quantized types that exist only as matmul operands: ggml has no to_float and ggml-cpu no vec_dot
# for them (ggml.c type_traits, ggml-cpu.c type_traits_cpu; a NULL call: test_ops_rules_cpu_traits.py)
OPERAND_ONLY = frozenset({int(GgmlType.Q8_1), int(GgmlType.Q8_K)})

Index = tuple[int, int]          # (source holding indices, exclusive upper bound)


class Refused(Exception):
    """A rule does not admit this node (the reason)."""


def need(cond: bool, reason: str) -> None:
    if not cond:
        raise Refused(reason)


@dataclass(frozen=True)
class Node:
    """What a rule sees: the destination (the node itself) and its sources."""

    dst: RpcTensor
    src: tuple[RpcTensor | None, ...]

    def s(self, i: int) -> RpcTensor:
        t = self.src[i]
        assert t is not None, f"src{i} read past the arity check"   # which runs before any rule
        return t

    def i32(self, k: int) -> int:
        v = self.dst.op_params[k]
        return v - (1 << 32) if v >= 1 << 31 else v

    def f32(self, k: int) -> float:
        return struct.unpack("<f", struct.pack("<I", self.dst.op_params[k] & 0xFFFFFFFF))[0]


@dataclass(frozen=True)
class Rule:
    arity: int                                  # required sources
    check: Callable[[Node], list[Index] | None]
    optional: int = 0                           # optional sources after the required ones
    # tensors whose nb0 may exceed the element size (src index, DST for the node): kernels that
    # ignore nb0 stay inside the span anyway (nb0 >= element size is checked for every tensor);
    # everything else must have nb0 == element size, as the kernels GGML_ASSERT
    strided: frozenset[int] = frozenset()


DST = -1
ANY = frozenset({DST, *range(abi.GGML_MAX_SRC)})


def dst_is(n: Node, type_: int, ne: tuple[int, ...], contiguous: bool = True) -> None:
    d = n.dst
    need(d.type == type_, f"dst type {type_name(d.type)}, ggml makes {type_name(type_)}")
    need(tuple(d.ne) == tuple(ne), f"dst shape {d.ne}, ggml makes {tuple(ne)}")
    if contiguous:                   # as ggml_new_tensor makes it (is_contiguous alone lets ne0 == 1 have any nb0)
        need(geo.is_contiguous(d) and d.nb[0] == geo.type_size(d), f"dst strides {d.nb} are not contiguous")


def like(n: Node, i: int = 0, type_: int | None = None, contiguous: bool = False) -> None:
    """dst has src i's shape (ggml_dup_tensor / ggml_view_tensor), with its type unless given."""
    s = n.s(i)
    dst_is(n, s.type if type_ is None else type_, s.ne, contiguous)


def types_in(n: Node, table: frozenset, *srcs: int) -> None:
    """(src types..., dst type) must be a row of ``table``."""
    key = tuple(n.s(i).type for i in srcs) + (n.dst.type,)
    need(key in table, f"types {', '.join(type_name(t) for t in key)} have no ggml-cpu kernel")


def is_type(t: RpcTensor, types: frozenset | int, what: str) -> None:
    allowed = types if isinstance(types, frozenset) else frozenset({types})
    need(t.type in allowed, f"{what} type {type_name(t.type)} not in {sorted(type_name(x) for x in allowed)}")


def unit_stride(t: RpcTensor, what: str) -> None:
    """nb0 is exactly the element size, for kernels that ``GGML_ASSERT(nb0 == sizeof(...))``: the
    generic check (ggml_is_contiguous_rows) lets a one-column tensor have any nb0."""
    need(t.nb[0] == geo.type_size(t), f"{what} nb0={t.nb[0]} must be the element size")


def unit_strides(n: Node, what: str, *tensors: int) -> None:
    """Sources (by index) or the dst (DST) whose nb0 the kernel GGML_ASSERTs to be the element size."""
    for i in tensors:
        unit_stride(n.dst if i == DST else n.s(i), f"{what} {'dst' if i == DST else f'src{i}'}")


def finite(x: float, what: str) -> None:
    """For float op_params that size something (ARANGE); the others only change values."""
    need(x == x and abs(x) != float("inf"), f"{what} is not finite")



def conv_out(ins: int, ks: int, s: int, p: int, d: int) -> int:
    """ggml_calc_conv_output_size, with C's truncating division."""
    num = ins + 2 * p - d * (ks - 1) - 1
    return int(num / s) + 1 if num >= 0 else ceil_div(num, s) + 1
