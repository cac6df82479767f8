"""Native handles (a plan's ggml context, the threadpool) are freed at most once, even when an
exception lands as their free returns: CPython runs a signal handler there, and the owner's
``close`` runs again while that exception unwinds (tests/server/test_rpc_stop.py end to end)."""

from __future__ import annotations

import ctypes
import signal

import numpy as np
import pytest

from ggml_rknpu.libggml import abi
from ggml_rknpu.libggml.compute import HostContext, Threads
from ggml_rknpu.libggml.enums import GgmlOp, GgmlType
from ggml_rknpu.libggml.lib import Ggml

_LIBC = ctypes.CDLL(None)


class Interrupted(BaseException):
    """What the signal handler raises (SystemExit or KeyboardInterrupt in the server)."""


class SignalAfterFree(Ggml):
    """The loaded ggml, but its frees record their handle and raise SIGUSR2 once through libc
    after the real free; a second free of a handle is recorded, never passed on to ggml.
    (A ``Ggml`` that loads nothing itself: every other function is ``g``'s.)"""

    def __init__(self, g: Ggml, names: tuple[str, ...]) -> None:
        self._g = g
        self.freed: list[int] = []
        for name in names:
            setattr(self, name, self._recording(getattr(g, name)))

    def __getattr__(self, name: str):
        return getattr(self._g, name)

    def _recording(self, free):
        def call(handle: int) -> None:
            seen = handle in self.freed
            self.freed.append(handle)
            if seen:
                return
            free(handle)
            if len(self.freed) == 1:
                getattr(_LIBC, "raise")(signal.SIGUSR2)
        return call


@pytest.fixture
def interrupting_handler():
    def handler(*_: object) -> None:
        raise Interrupted()
    old = signal.signal(signal.SIGUSR2, handler)
    yield
    signal.signal(signal.SIGUSR2, old)


def test_a_context_interrupted_as_it_is_freed_is_not_freed_again(host_ggml, interrupting_handler):
    g = SignalAfterFree(host_ggml, ("ggml_free",))
    threads = Threads(host_ggml, 1)
    try:
        host = HostContext(g, threads, 4, (1,))
        a, b, out = (np.ones(8, np.float32) for _ in range(3))
        ta, tb = (host.tensor(GgmlType.F32, (8, 1, 1, 1), (4, 32, 32, 32), 0, (), 0, n, (x.view(np.uint8), 0))
                  for n, x in (("a", a), ("b", b)))
        t = host.tensor(GgmlType.F32, (8, 1, 1, 1), (4, 32, 32, 32), int(GgmlOp.ADD), (),
                        abi.GGML_TENSOR_FLAG_COMPUTE, "a+b", (out.view(np.uint8), 0))
        host.link(t, [ta, tb], None, 0)
        host.segment([t]).run()
        host.finish()
        np.testing.assert_array_equal(out, 2)
        ctx = host.ctx
        with pytest.raises(Interrupted):
            host.close()
        host.close()                                     # the unwinding owner closes it again
        assert g.freed == [ctx], "a context freed twice"
    finally:
        threads.close()


def test_a_threadpool_interrupted_as_it_is_freed_is_not_freed_again(host_ggml, interrupting_handler):
    g = SignalAfterFree(host_ggml, ("ggml_threadpool_free",))
    threads = Threads(g, 1)
    pool = threads.pool
    with pytest.raises(Interrupted):
        threads.close()
    threads.close()
    assert g.freed == [pool], "a threadpool freed twice"
