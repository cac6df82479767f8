"""Staged weights shared by the live sessions of one server, by content.

Two clients that load the same model (llama-server and a llama-completion next to it, or two
slots' worth of processes) upload the same bytes; the second gets the first one's staged copy
instead of converting and uploading its own. The key is the reuse key of ``RetiredWeights``
(SHA-256 of the exact bytes, type, layout, format), so a weight with any different byte never
matches. Invariants: an entry counts its users (slots of live sessions); the last user's release
hands the copy back to its caller, which retires or frees it as before; a copy an NPU reset
destroyed is forgotten by every session at once (``restage``); ``npu_bytes`` is the NPU size
of the distinct copies (the retired copies make room beside it, ``RetiredWeights``). Used under the server's turn
(``server.turns``) only, so it needs no lock of its own."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ggml_rknpu.engine.contract import EngineWeight


class LiveWeights:
    def __init__(self) -> None:
        self._by_key: dict[tuple, list[Any]] = {}     # key -> [handle, users]
        self._stores: dict[int, Any] = {}             # id -> WeightStore of a live session
        self.shared = 0                               # stagings served from another session's copy
        self.npu_bytes = 0                            # packed bytes of the distinct copies

    @property
    def copies(self) -> int:
        """Distinct staged copies the live sessions use now."""
        return len(self._by_key)

    def users(self, key: tuple) -> int:
        entry = self._by_key.get(key)
        return 0 if entry is None else entry[1]

    def acquire(self, key: tuple) -> EngineWeight | None:
        """Another session's staged copy of ``key`` (one more user), or None."""
        entry = self._by_key.get(key)
        if entry is None:
            return None
        entry[1] += 1
        self.shared += 1
        return entry[0]

    def add(self, key: tuple, handle: EngineWeight) -> None:
        """``handle`` is staged now under ``key``, with one user."""
        self._by_key[key] = [handle, 1]
        self.npu_bytes += handle.packed_bytes

    def release(self, key: tuple, handle: EngineWeight) -> bool:
        """One user fewer; True if that was the last (the caller retires or frees ``handle``)."""
        entry = self._by_key.get(key)
        if entry is None or entry[0] is not handle:
            return True
        entry[1] -= 1
        if entry[1] > 0:
            return False
        del self._by_key[key]
        self.npu_bytes -= handle.packed_bytes
        return True

    def attach(self, store: Any) -> None:
        self._stores[id(store)] = store

    def detach(self, store: Any) -> None:
        self._stores.pop(id(store), None)

    def restage(self, lost: Callable[[EngineWeight], bool]) -> int:
        """An NPU reset destroyed the copies ``lost`` names: every session forgets them (each
        re-stages at its next use). Returns how many slots forgot one."""
        self._by_key = {k: e for k, e in self._by_key.items() if not lost(e[0])}
        self.npu_bytes = sum(e[0].packed_bytes for e in self._by_key.values())
        return sum(store.restage_own(lost) for store in list(self._stores.values()))

    def as_dict(self) -> dict:
        return {"copies": self.copies, "users": sum(e[1] for e in self._by_key.values()), "shared": self.shared,
                "npu_bytes": self.npu_bytes}
