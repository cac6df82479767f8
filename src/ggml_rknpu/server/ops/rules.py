"""The validator: every op the server admits has a rule, checked at plan time.

Invariants: a node reaches ggml-cpu only when its rule admits it (ggml-cpu trusts its
graph: a bad shape or index aborts the process); a rule states, from the pinned ggml, the
source arity, the types the CPU kernel implements (as data, the ``*_TYPES`` tables), the
dst the op's builder would make, the strides the kernel assumes, enum-valued op_params in
range, and which sources hold indices (:class:`IndexCheck`); every tensor's checked span
covers its dense size. Anything else raises :class:`UnsupportedOp`. :data:`RULES` is the
one table of every admitted op, merged from the families' modules (``rules_elementwise``,
``rules_shapes``, ``rules_matmul``, ``rules_conv``, ``rules_recurrent``, ``rules_training``,
``rules_dsv4``). Why rules as data: docs/decisions.md "server/ops/rules.py"."""

from __future__ import annotations

from ggml_rknpu.libggml import abi
from ggml_rknpu.libggml.enums import GgmlGluOp, GgmlOp, GgmlUnaryOp
from ggml_rknpu.server.ops import geometry as geo
from ggml_rknpu.server.ops.rulekit import Index, Node, Refused, RpcTensor, Rule, need
from ggml_rknpu.server.ops.rules_conv import RULES as CONV_RULES
from ggml_rknpu.server.ops.rules_dsv4 import RULES as DSV4_RULES
from ggml_rknpu.server.ops.rules_elementwise import RULES as ELEMENTWISE_RULES
from ggml_rknpu.server.ops.rules_matmul import RULES as MATMUL_RULES
from ggml_rknpu.server.ops.rules_recurrent import RULES as RECURRENT_RULES
from ggml_rknpu.server.ops.rules_shapes import RULES as SHAPES_RULES
from ggml_rknpu.server.ops.rules_training import RULES as TRAINING_RULES
from ggml_rknpu.server.ops.vocabulary import UnsupportedOp, op_name, type_name

# every admitted op, in one table: each family's rules in its own module
RULES: dict[int, Rule] = {**ELEMENTWISE_RULES, **SHAPES_RULES, **MATMUL_RULES, **CONV_RULES, **RECURRENT_RULES,
                          **TRAINING_RULES, **DSV4_RULES}


def signature(t: RpcTensor, srcs: tuple[RpcTensor | None, ...]) -> str:
    """``OP[:SUB](src types)->dst type``, e.g. ``UNARY:SILU(f32)->f32`` (what the server logs)."""
    name = op_name(t.op)
    if t.op in (GgmlOp.UNARY, GgmlOp.GLU):
        enum = GgmlUnaryOp if t.op == GgmlOp.UNARY else GgmlGluOp
        sub = t.op_params[0]
        try:
            name += ":" + enum(sub).name
        except ValueError:
            name += f":{sub}"
    types = ",".join(type_name(s.type) if s is not None else "-" for s in srcs).rstrip(",-")
    return f"{name}({types})->{type_name(t.type)}"


def check_node(t: RpcTensor, srcs: tuple[RpcTensor | None, ...]) -> list[Index]:
    """The index checks the node needs, or :class:`UnsupportedOp` when no rule admits it."""
    rule = RULES.get(t.op)
    if rule is None:
        raise UnsupportedOp(signature(t, srcs), "no rule admits this op")
    srcs = tuple(srcs) + (None,) * (abi.GGML_MAX_SRC - len(srcs))
    try:
        for i in range(rule.arity):
            need(srcs[i] is not None, f"missing source {i}")
        for i in range(rule.arity + rule.optional, len(srcs)):
            need(srcs[i] is None, f"unexpected source {i}")
        for i, s in enumerate((t, *srcs)):
            if s is None:
                continue
            what = "dst" if i == 0 else f"src{i - 1}"
            need(geo.covers_dense(s) and (s.nb[0] >= geo.type_size(s) or geo.is_empty(s)),
                 f"{what} strides {s.nb} overlap its elements")
            if (i - 1) not in rule.strided:
                need(geo.is_contiguous_rows(s) or geo.is_empty(s), f"{what} nb0={s.nb[0]} is not the element size")
        return rule.check(Node(t, srcs)) or []
    except Refused as exc:
        raise UnsupportedOp(signature(t, srcs), str(exc)) from None
