"""Turns at the device: the FIFO lock the concurrent sessions of one server take for every piece
of work that touches what they share (the NPU engine, ggml-cpu's threadpool, the staged weights,
the device budget, the counters).

Invariants: a turn is handed over strictly in the order it was asked for (a ticket queue: the
releasing session wakes exactly the oldest waiter and gives it the lock directly, so a session
that loops on GRAPH_COMPUTE cannot take the next turn ahead of one that has been waiting); a turn
is never held across socket I/O, so a stalled client never holds one. Not reentrant. Why a
queue and not ``threading.Lock``: CPython's lock is not fair, and a thread that releases and
re-acquires at once usually wins it again (docs/server.md "Concurrent sessions")."""

from __future__ import annotations

import threading
import time
from collections import deque


class Turns:
    """A fair (FIFO) mutex with counters: turns granted, and the time sessions waited for one."""

    def __init__(self) -> None:
        self._mutex = threading.Lock()
        self._held = False
        self._waiters: deque[threading.Lock] = deque()
        self.granted = 0
        self.waited = 0               # turns that had to wait for another session's
        self.wait_seconds = 0.0

    def __enter__(self) -> Turns:
        with self._mutex:
            self.granted += 1
            if not self._held:
                self._held = True
                return self
            baton = threading.Lock()
            baton.acquire()
            self._waiters.append(baton)
            self.waited += 1
        t0 = time.perf_counter()
        baton.acquire()               # released by the previous holder: the turn is ours
        self.wait_seconds += time.perf_counter() - t0   # only the holder writes it
        return self

    def __exit__(self, *exc: object) -> None:
        with self._mutex:
            if self._waiters:
                self._waiters.popleft().release()   # ownership passes directly; _held stays True
            else:
                self._held = False

    def as_dict(self) -> dict:
        return {"granted": self.granted, "waited": self.waited, "wait_seconds": round(self.wait_seconds, 3)}
