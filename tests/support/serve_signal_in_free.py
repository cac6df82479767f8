"""``rknpu serve`` whose first freed ggml context gets a signal while ``ggml_free`` runs.

Usage: ``python serve_signal_in_free.py SIGNAL COUNT serve ...`` (the serve arguments follow).
The process-wide binding's ``ggml_free`` is wrapped: every call prints ``ggml_free <ctx>``;
the first one raises SIGNAL COUNT times through libc right after the real free, so CPython
runs the handler as that ctypes call returns, as it does when the signal arrives during the
free. A context freed a second time is reported as ``double ggml_free <ctx>`` and not passed
to ggml (the test reads the report; the process must not corrupt its heap to show it).
"""

from __future__ import annotations

import ctypes
import signal
import sys

from ggml_rknpu.libggml import lib

_LIBC = ctypes.CDLL(None)


def _instrumented_load(real_load, signum: int, count: int):
    freed: set[int] = set()
    wrapped: set[int] = set()        # ids of the bindings whose ggml_free is wrapped already

    def load() -> lib.Ggml:
        g = real_load()
        if id(g) in wrapped:
            return g
        wrapped.add(id(g))
        real_free = g.ggml_free

        def ggml_free(ctx: int) -> None:
            if ctx in freed:
                print(f"double ggml_free {ctx:#x}", file=sys.stderr, flush=True)
                return
            print(f"ggml_free {ctx:#x}", file=sys.stderr, flush=True)
            first = not freed
            freed.add(ctx)
            real_free(ctx)
            if first:
                for _ in range(count):
                    getattr(_LIBC, "raise")(signum)

        g.ggml_free = ggml_free
        return g

    return load


def main() -> int:
    signum, count = int(getattr(signal, sys.argv[1])), int(sys.argv[2])
    lib.load = _instrumented_load(lib.load, signum, count)
    from ggml_rknpu.cli.main import main as rknpu_main
    return rknpu_main(sys.argv[3:])


if __name__ == "__main__":
    sys.exit(main())
