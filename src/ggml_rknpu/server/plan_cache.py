"""The plans of one device: the last one (GRAPH_RECOMPUTE) and recent ones by payload digest.

Invariants: a plan is closed exactly once, when no entry holds it any more; identical
payloads (same blake2b digest) reuse their plan. Why: docs/decisions.md "server/planner.py"."""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from dataclasses import dataclass, field

from ggml_rknpu.server.plan import GraphPlan

PLANS_PER_DEVICE = 1024
# identical-graph cache: partial offload (-ot) sends ~90 splits per token [docs/ggml-rpc.md §5.1], and
# speculative decoding / parallel slots send each split at every batch size they alternate
# between (1..n_draft+1): 90 x 4 already overflowed 256 and re-planned every split every pass.
# 1024 is also upstream's graph cache size in RPC protocol 8 (docs/ggml-rpc.md §3.5).


@dataclass
class DeviceGraphs:
    """Per device: the last graph (GRAPH_RECOMPUTE) and recent plans by payload digest."""

    last: GraphPlan | None = None
    by_digest: OrderedDict[bytes, GraphPlan] = field(default_factory=OrderedDict)

    def lookup(self, digest: bytes) -> GraphPlan | None:
        plan = self.by_digest.get(digest)
        if plan is not None:
            self.by_digest.move_to_end(digest)
        return plan

    def remember(self, plan: GraphPlan) -> None:
        old = self.by_digest.get(plan.digest)
        if old is not None and old is not plan:
            old.close()
        self.by_digest[plan.digest] = plan
        self.by_digest.move_to_end(plan.digest)
        while len(self.by_digest) > PLANS_PER_DEVICE:
            _, evicted = self.by_digest.popitem(last=False)
            if evicted is not self.last:
                evicted.close()
        if self.last is not None and self.last is not plan and self.last.digest not in self.by_digest:
            self.last.close()
        self.last = plan

    def clear(self) -> None:
        """Free every plan (their ggml contexts point into buffers that may go away now)."""
        plans = {id(p): p for p in self.by_digest.values()}
        if self.last is not None:
            plans[id(self.last)] = self.last
        for plan in plans.values():
            plan.close()
        self.last = None
        self.by_digest.clear()


def graph_digest(payload: bytes | memoryview) -> bytes:
    return hashlib.blake2b(payload, digest_size=16).digest()
