"""Malformed graphs for the validator's wire tests: one node per admitted op as ggml's own
builders make it, the mutations that make it wrong, and the client side that lays a node out
in the server's buffers and sends it (tests/server/test_rpc_malformed.py against a server in
this process, tests/server/test_rpc_fuzz_asan.py against `rknpu serve` on the AddressSanitizer
build of ggml)."""

from __future__ import annotations

import ctypes
import dataclasses
from dataclasses import dataclass

import numpy as np

from ggml_rknpu.hw.alignment import align_up
from ggml_rknpu.libggml import abi
from ggml_rknpu.libggml.enums import TYPE_TRAITS, GgmlOp, GgmlTensorFlag, GgmlType
from ggml_rknpu.libggml.lib import TensorP
from ggml_rknpu.server.ops import geometry as geo
from ggml_rknpu.server.ops.rules import RULES, check_node
from ggml_rknpu.server.tensor import RpcTensor
from support.ggml_builders import F16, F32, I32, Scratch, _made_by_ggml
from support.rpc_testkit import RpcClient, ServerClosed, T

I64 = int(GgmlType.I64)
_F, _I, _B, _I64 = ctypes.c_float, ctypes.c_int, ctypes.c_bool, ctypes.c_int64

# always wrong: the validator must refuse every one of them
BAD = ("dst shape", "dst type", "missing src", "overlap", "index high", "index negative")
# may still be a valid node (another eps, a broadcastable source, another source type, a strided
# view): refused or computed, and either way nothing out of bounds (what the sanitizer judges)
MAYBE = ("op_params", "src shape", "src type", "src strides")
MUTATIONS = BAD + MAYBE
# ops whose dst shape the client chooses (ggml_interpolate's ne; the shape tensor of get_rows_back and
# repeat_back, which is no source): another dst shape can be a valid node, so "dst shape" does not apply
CLIENT_SHAPED = frozenset({GgmlOp.UPSCALE, GgmlOp.GET_ROWS_BACK, GgmlOp.REPEAT_BACK})


@dataclass(frozen=True)
class Case:
    label: str
    node: RpcTensor
    srcs: tuple[RpcTensor | None, ...]
    index: dict[int, int]                 # source -> exclusive bound of its indices (the rule's IndexChecks)


def _more_made_by_ggml(sc: Scratch):
    """(label, builder result) for the admitted ops ``_made_by_ggml`` leaves out."""
    new = sc.new
    T_ = TensorP

    def call(name: str, argtypes: list, *args):
        f = getattr(sc.g.base, name)
        f.restype, f.argtypes = TensorP, [ctypes.c_void_p, *argtypes]
        return f(sc.ctx, *args)

    a = new(F32, 64, 7, 3, 2)
    for name in ("ggml_sqr", "ggml_sqrt", "ggml_log", "ggml_sin", "ggml_cos", "ggml_sum", "ggml_dup"):
        yield name[5:], call(name, [T_], a)
    yield "cont", call("ggml_cont", [T_], a)
    yield "sub", call("ggml_sub", [T_, T_], a, new(F32, 64, 1, 3, 1))
    yield "add1", call("ggml_add1", [T_, T_], a, new(F32, 1))
    yield "leaky_relu", call("ggml_leaky_relu", [T_, _F, _B], a, 0.1, False)
    yield "clamp", call("ggml_clamp", [T_, _F, _F], a, -1.0, 1.0)
    yield "fill", call("ggml_fill", [T_, _F], a, 1.5)
    yield "l2_norm", call("ggml_l2_norm", [T_, _F], a, 1e-6)
    yield "group_norm", call("ggml_group_norm", [T_, _I, _F], new(F32, 8, 8, 4), 2, 1e-5)
    yield "count_equal", call("ggml_count_equal", [T_, T_], new(I32, 10, 3), new(I32, 10, 3))
    yield "tri", call("ggml_tri", [T_, _I], new(F32, 8, 8, 2), abi.GGML_TRI_TYPE_LOWER)
    yield "diag_mask_inf", call("ggml_diag_mask_inf", [T_, _I], new(F32, 16, 5, 4), 2)
    yield "diag_mask_zero", call("ggml_diag_mask_zero", [T_, _I], new(F32, 16, 5, 4), 2)
    yield "arange", call("ggml_arange", [_F, _F, _F], 0.0, 10.0, 1.0)
    yield "timestep_embedding", call("ggml_timestep_embedding", [T_, _I, _I], new(F32, 5), 16, 10000)
    yield "roll", call("ggml_roll", [T_, _I, _I, _I, _I], new(F32, 8, 4, 2), 1, 1, 0, 0)
    yield "diag", call("ggml_diag", [T_], new(F32, 8, 1, 2))
    yield "im2col 2d", call("ggml_im2col", [T_, T_, _I, _I, _I, _I, _I, _I, _B, _I], new(F16, 3, 3, 2, 4),
                            new(F32, 8, 8, 2, 1), 1, 1, 1, 1, 1, 1, True, F32)
    # mamba-2: d_state 16, head_dim 4, 2 heads, 3 tokens, 2 sequences out of 3 states (ids)
    yield "ssm_scan", call("ggml_ssm_scan", [T_] * 7 + [_I64], new(F32, 16, 4, 2, 3), new(F32, 4, 2, 3, 2),
                           new(F32, 2, 3, 2), new(F32, 1, 2), new(F32, 16, 1, 3, 2), new(F32, 16, 1, 3, 2),
                           new(I32, 2), 1)
    yield "gated_delta_net", call("ggml_gated_delta_net", [T_] * 6 + [_I64], *(new(F32, 8, 2, 3, 1) for _ in range(3)),
                                  new(F32, 1, 2, 3, 1), new(F32, 1, 2, 3, 1), new(F32, 8, 8, 2, 1), 1)
    yield "rwkv_wkv6", call("ggml_rwkv_wkv6", [T_] * 6, new(F32, 4, 2, 3), new(F32, 4, 2, 3), new(F32, 4, 2, 3),
                            new(F32, 4, 2), new(F32, 4, 2, 3), new(F32, 32, 1))
    yield "rwkv_wkv7", call("ggml_rwkv_wkv7", [T_] * 7, *(new(F32, 64, 1, 2) for _ in range(6)), new(F32, 4096, 1))
    yield "gated_linear_attn", call("ggml_gated_linear_attn", [T_] * 5 + [_F],
                                    *(new(F32, 4, 2, 3) for _ in range(4)), new(F32, 32, 1), 0.5)
    yield "solve_tri", call("ggml_solve_tri", [T_, T_, _B, _B, _B], new(F32, 8, 8, 2), new(F32, 3, 8, 2),
                            True, True, False)


def builder_cases(g, more: bool = True) -> list[Case]:
    """Every builder node the validator admits, with its index bounds. Nodes whose source is itself
    a view node are left out (the tensor tests cover views)."""
    out = []
    for made in (_made_by_ggml, _more_made_by_ggml) if more else (_made_by_ggml,):
        sc = Scratch(g)
        try:
            for label, t in made(sc):
                node, srcs = sc.node(t)
                if any(s is not None and s.view_src for s in srcs):
                    continue
                out.append(Case(label, node, srcs, dict(check_node(node, srcs))))
        finally:
            sc.close()
    return out


Dims = tuple[int, int, int, int]


def _dims(values: list[int]) -> Dims:
    a, b, c, d = values
    return a, b, c, d


def _contiguous_nb(type_: int, ne: Dims, like: Dims) -> Dims:
    block, size = TYPE_TRAITS[GgmlType(type_)]
    if ne[0] % block:
        return like                                    # no dense layout of this type: keep the strides
    nb1 = size * (ne[0] // block)
    return (size, nb1, nb1 * ne[1], nb1 * ne[1] * ne[2])


def mutate(case: Case, how: str, value: int):
    """(node, srcs, bad index value or None) after mutation ``how``, or None where it does not apply
    (no index source, no source to drop, ...)."""
    node, srcs = case.node, case.srcs
    present = [s for s in srcs if s is not None and s.id != node.id]
    if how.startswith("index"):
        if not case.index:
            return None
        bound = case.index[sorted(case.index)[value % len(case.index)]]
        return node, srcs, bound + value % 7 if how == "index high" else -1 - value % 5
    if how == "dst shape":
        if node.op in CLIENT_SHAPED:
            return None
        return dataclasses.replace(node, ne=(node.ne[0], node.ne[1] + 1 + value % 3, *node.ne[2:])), srcs, None
    if how == "dst type":
        if node.id in node.src:                  # ggml_cast: the dst type is the client's choice
            return None
        types = [int(t) for t in GgmlType if int(t) != node.type]
        return dataclasses.replace(node, type=types[value % len(types)]), srcs, None
    if how == "missing src":                     # a required one (optional sources may be absent)
        required = [i for i, s in enumerate(node.src) if s and i < RULES[node.op].arity]
        if not required:
            return None
        k = required[value % len(required)]
        return dataclasses.replace(node, src=tuple(0 if i == k else s for i, s in enumerate(node.src))), srcs, None
    if how == "overlap":
        wide = [d for d in range(4) if node.ne[d] > 1] or [0]
        nb = list(node.nb)
        nb[wide[-1]] = value % max(1, nb[wide[-1]])
        return dataclasses.replace(node, nb=_dims(nb)), srcs, None
    if how == "op_params":
        params = list(node.op_params)
        params[value % 4] = (value * 2654435761) % (1 << 31) - (1 << 30)
        return dataclasses.replace(node, op_params=tuple(params)), srcs, None
    if not present:
        return None
    s = present[value % len(present)]
    if how == "src shape":                       # one more row, plane or batch (blocks stay whole)
        d = 1 + value % 3
        ne = _dims([n + 1 + value % 2 if i == d else n for i, n in enumerate(s.ne)])
        s = dataclasses.replace(s, ne=ne, nb=_contiguous_nb(s.type, ne, s.nb))
    elif how == "src type":
        types = [int(t) for t in GgmlType if int(t) != s.type]
        type_ = types[value % len(types)]
        s = dataclasses.replace(s, type=type_, nb=_contiguous_nb(type_, s.ne, s.nb))
    elif how == "src strides":                   # shrink (overlap) or widen (a strided view) one stride
        d = value % 4
        nb = list(s.nb)
        nb[d] = nb[d] * (2 + value % 3) if value & 1 else value % max(1, nb[d])
        s = dataclasses.replace(s, nb=_dims(nb))
    else:
        raise ValueError(how)
    return node, tuple(s if x is not None and x.id == s.id else x for x in srcs), None   # every use of it


def _fill(s: RpcTensor, index: dict[int, int], i: int, bad_index: int | None, rng) -> bytes:
    n = geo.span(s)
    if i in index:
        values = rng.integers(0, max(index[i], 1), max(geo.nelements(s), 1))
        if bad_index is not None:
            values[rng.integers(0, len(values))] = bad_index
        return values.astype(np.int64 if s.type == I64 else np.int32).tobytes()[:n]
    size = TYPE_TRAITS[GgmlType(s.type)][1]
    if TYPE_TRAITS[GgmlType(s.type)][0] > 1 or s.type in (I32, I64) or size not in (2, 4):
        return rng.integers(0, 256, n, dtype=np.uint8).tobytes()
    return rng.standard_normal(n // size).astype(np.float16 if size == 2 else np.float32).tobytes()


def send(c: RpcClient, node: RpcTensor, srcs: tuple, index: dict[int, int], bad_index: int | None = None,
         separate: bool = False, uid: int = 0) -> T:
    """Lay the node and its sources out in the server's memory, fill the sources, GRAPH_COMPUTE;
    the node as placed. ``separate``: every tensor in its own buffer of exactly its span, so a
    kernel reading past any tensor leaves the buffer (what AddressSanitizer sees); otherwise
    one buffer with gaps and slack. ``uid``: the graph's uid on a protocol-8 connection."""
    tensors = [s for s in srcs if s is not None and s.id != node.id]   # not a self-reference
    placed: dict[int, T] = {}
    if not separate:
        sizes = [max(geo.span(t), 1) for t in (*tensors, node)]
        h, addr = c.alloc_base(sum(align_up(n, 64) for n in sizes) + 64 * len(sizes) + (1 << 16))
    for t in (*tensors, node):
        if t.id in placed:
            continue
        if separate:
            h, addr = c.alloc_base(max(geo.span(t), 1))
        at_h, at = h, addr
        if t is node and node.view_src in placed:      # a view node (CPY, SET_ROWS, OPT_STEP_*, inplace
            base = placed[node.view_src]               # ACC/SET) lives in its source's bytes, as a client's
            at_h, at = base.buffer, base.data + node.view_offs
        placed[t.id] = T(ne=t.ne, nb=t.nb, type=t.type, buffer=at_h, data=at, op=t.op if t is node else 0,
                         op_params=t.op_params, src=t.src if t is node else (), id=t.id,
                         # a client's graph node carries COMPUTE (ggml_build_forward_expand); the
                         # builders' tensors were never in a graph
                         flags=t.flags | GgmlTensorFlag.COMPUTE if t is node else 0)
        if not separate:
            addr += align_up(max(geo.span(t), 1), 64) + 64
    rng = np.random.default_rng(0)
    for i, s in enumerate(srcs):
        if s is not None and s.id != node.id and geo.span(s):
            c.set_tensor(placed[s.id], _fill(s, index, i, bad_index, rng))
    c.graph_compute([placed[node.id]], list(placed.values()), uid=uid)
    return placed[node.id]


def still_talking(c: RpcClient, timeout: float = 10.0) -> bool:
    """After a GRAPH_COMPUTE: True when the server answers the next command on this connection
    (it computed the graph), False when it closed the connection (it refused it)."""
    c.sock.settimeout(timeout)
    try:
        return c.device_count() == 1
    except (ServerClosed, ConnectionResetError, BrokenPipeError):
        return False
