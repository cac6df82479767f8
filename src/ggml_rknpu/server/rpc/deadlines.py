"""A client connection's bytes under the server's timeouts [docs/server.md "Message deadlines"].

Inside a message, and inside a reply, two bounds hold: every recv or send makes progress
within the stall timeout, and the whole arrives (or is taken) within ``stall_timeout +
bytes / min_rate`` of its first byte. A slow link that keeps its pace is served; a client
that stops (a staller) or sends a byte now and then, each within the stall timeout (a
trickler), is dropped. A request's allowance grows as the server asks for its payload, so
an announced size buys no time before the part that checks it has arrived; the 9-byte
header has the stall timeout alone. Both bounds are one socket timeout per recv or send:
min(stall timeout, time left), from one ``monotonic()`` per call. Between messages only
the idle timeout applies (off by default)."""

from __future__ import annotations

import select
import socket
import time

MIN_RATE_KIB_S = 64.0   # --min-rate: 0.52 Mbit/s, 4-15x under a link of a few Mbit/s (a choice: docs/server.md)
KIB = 1024
RECV_CHUNK = 1 << 16            # the read buffer; a remainder this large is received in place


class ClientGone(Exception):
    """EOF from the client: a goodbye at a message boundary, or a truncated message."""

    def __init__(self, truncated: bool) -> None:
        super().__init__("message truncated by EOF" if truncated else "client closed the connection")
        self.truncated = truncated


class IdleTimeout(Exception):
    """No message started within ``--idle-timeout`` of the last one."""


class Stalled(Exception):
    """No byte moved for ``--stall-timeout`` inside a message or a reply."""


class TooSlow(Exception):
    """A message or a reply not complete by its deadline, though its bytes kept coming."""


class Deadlines:
    """The socket timeouts of one connection: the deadline of the message or reply in
    progress, enforced through the timeout of each recv and send."""

    def __init__(self, sock: socket.socket, stall_s: float, min_rate_kib_s: float) -> None:
        self.sock = sock
        self.stall_s = stall_s
        self.min_rate_kib_s = min_rate_kib_s
        self._s_per_byte = 1.0 / (min_rate_kib_s * KIB)
        self.what = "a message header"
        self.start = self.deadline = self._progress_at = time.monotonic()
        self.allowed = 0                   # bytes the deadline includes beyond the stall timeout
        self._short = False                # the socket timeout is the time left, not the stall timeout
        self._moved = False                # bytes moved since the last arm: progress_at is due
        sock.settimeout(stall_s)

    def begin(self, what: str, n: int = 0) -> None:
        """A message (its first byte is here) or a reply starts now, with ``n`` bytes allowed."""
        now = time.monotonic()
        self.what, self.start, self._progress_at, self._moved = what, now, now, False
        self.allowed = n
        self.deadline = now + self.stall_s + n * self._s_per_byte

    def allow(self, n: int) -> None:
        """The server asks for ``n`` more bytes of this message: its deadline moves by n / min_rate."""
        self.allowed += n
        self.deadline += n * self._s_per_byte

    def _arm(self) -> None:
        now = time.monotonic()
        if self._moved:                    # the last call moved bytes: the client's progress, ~now
            self._progress_at, self._moved = now, False
        left = self.deadline - now
        if left >= self.stall_s:
            if self._short:
                self.sock.settimeout(self.stall_s)
                self._short = False
        elif left > 0:
            self.sock.settimeout(left)
            self._short = True
        else:
            raise self._expired(now)

    def _expired(self, now: float) -> Exception:
        """The deadline passed: a stall if nothing moved for the stall timeout, else too slow."""
        if now - self._progress_at >= self.stall_s:
            return self._stalled()
        if self.allowed == 0:
            return TooSlow(f"{self.what} not complete within {self.stall_s:g} s of its first byte "
                           f"(--stall-timeout)")
        return TooSlow(f"{self.what} not complete within {self.deadline - self.start:.1f} s (--stall-timeout "
                       f"{self.stall_s:g} s + {self.allowed} bytes at --min-rate {self.min_rate_kib_s:g} KiB/s)")

    def _stalled(self) -> Stalled:
        return Stalled(f"no progress for {self.stall_s:g} s in {self.what} (--stall-timeout)")

    def _timed_out(self, exc: TimeoutError) -> Exception:
        """Our socket timeout's verdict; the kernel's (TCP keepalive: an errno) stays as it is."""
        if exc.errno is not None:
            return exc
        return self._expired(time.monotonic()) if self._short else self._stalled()

    def recv_into(self, view: memoryview, n: int) -> int:
        self._arm()
        try:
            got = self.sock.recv_into(view, n)
        except TimeoutError as exc:
            raise self._timed_out(exc) from None
        self._moved = True
        return got

    def send(self, *parts: bytes | memoryview) -> None:
        """One reply, bounded like a message (``sendall`` with a timeout would bound the whole
        call by the stall timeout, cutting a large GET_TENSOR to a slow reader)."""
        views = [memoryview(p).cast("B") for p in parts]
        n = sum(len(v) for v in views)
        self.begin(f"a reply of {n} bytes", n)
        for view in views:
            pos = 0
            while pos < len(view):
                self._arm()
                try:
                    pos += self.sock.send(view[pos:])
                except TimeoutError as exc:
                    raise self._timed_out(exc) from None
                self._moved = True


class Reader:
    """Buffered exact reads from a client; big payloads go straight into their destination."""

    def __init__(self, deadlines: Deadlines) -> None:
        self._deadlines = deadlines
        self._sock = deadlines.sock
        self._buf = bytearray(RECV_CHUNK)
        self._view = memoryview(self._buf)
        self._lo = 0
        self._hi = 0
        self.total = 0
        self._idle = select.poll()
        self._idle.register(deadlines.sock, select.POLLIN)

    def _filled(self, n: int, at_boundary: bool) -> None:
        if n == 0:
            raise ClientGone(truncated=not at_boundary)
        self._lo, self._hi = 0, n
        self.total += n

    def next_header(self, size: int, idle_s: float | None = None) -> bytes:
        """Wait for the next message (EOF here is a clean goodbye) and read its ``size``-byte
        header within the stall timeout of its first byte.

        Between messages a client may stay idle for as long as it likes by default
        (llama-server holds its connection for hours while waiting for HTTP requests):
        ``idle_s`` None; otherwise ``IdleTimeout`` after ``idle_s`` seconds without a byte."""
        if self._lo == self._hi:
            # poll, not select: no FD_SETSIZE limit on the socket's fd
            if not self._idle.poll(None if idle_s is None else max(1, int(idle_s * 1000))):
                raise IdleTimeout(f"no message for {idle_s:.0f} s")
            # bytes (or EOF) are ready: this recv does not wait, and is not the message's progress
            self._filled(self._sock.recv_into(self._view, RECV_CHUNK), True)
        self._deadlines.begin(f"a message header ({size} bytes)")
        return self._take(size)

    def read(self, n: int) -> bytes:
        """``n`` bytes of the current message's payload (its deadline grows by n / min_rate)."""
        self._deadlines.allow(n)
        return self._take(n)

    def read_into(self, target: memoryview) -> None:
        """Payload bytes straight into ``target`` (its deadline grows by len / min_rate)."""
        self._deadlines.allow(len(target))
        self._take_into(target)

    def _take(self, n: int) -> bytes:
        avail = self._hi - self._lo
        if n <= avail:
            out = bytes(self._view[self._lo:self._lo + n])
            self._lo += n
            return out
        whole = bytearray(n)
        self._take_into(memoryview(whole))
        return bytes(whole)

    def _take_into(self, target: memoryview) -> None:
        n = len(target)
        pos = min(n, self._hi - self._lo)
        target[:pos] = self._view[self._lo:self._lo + pos]
        self._lo += pos
        deadlines = self._deadlines
        while pos < n:
            if n - pos >= RECV_CHUNK:               # large remainder: straight into the target
                got = deadlines.recv_into(target[pos:], n - pos)
                if got == 0:
                    raise ClientGone(truncated=True)
                self.total += got
                pos += got
            else:
                self._filled(deadlines.recv_into(self._view, RECV_CHUNK), False)
                take = min(n - pos, self._hi)
                target[pos:pos + take] = self._view[:take]
                self._lo = take
                pos += take
