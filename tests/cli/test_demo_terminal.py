"""The demo's shared terminal: the generated text and the server's output (its staging bar, its
log) never share a line, and stdout stays exactly the generated text."""

from __future__ import annotations

import io
import os
import threading

from ggml_rknpu.cli.demo import SharedTerminal


class Screen(io.BytesIO):
    """One terminal both streams write to, in the order they flush; remembers stdout on its own."""

    def __init__(self) -> None:
        super().__init__()
        self.stdout = io.BytesIO()

    def text_stream(self) -> io.BytesIO:
        screen = self

        class Text(io.BytesIO):
            def write(self, data) -> int:      # type: ignore[override]
                screen.stdout.write(data)
                return screen.write(data)
        return Text()


def test_the_staging_bar_cuts_in_on_its_own_lines_and_the_text_line_is_shown_whole():
    screen = Screen()
    term = SharedTerminal(screen.text_stream(), screen)
    term.write("text", b"The capital of France is")
    term.write("server", b"staging weights (fp16) \xe2\x94\x81\xe2\x94\x81 100%\n")
    term.write("server", b"2026-12-06 INFO staged 236 weights\n")
    term.write("text", b" the capital of")
    term.write("text", b" the country.\n")
    term.say("demo: llama-completion exited with 0")
    assert screen.getvalue().decode().splitlines() == [
        "The capital of France is",
        "staging weights (fp16) ━━ 100%",
        "2026-12-06 INFO staged 236 weights",
        "The capital of France is the capital of the country.",
        "demo: llama-completion exited with 0"]
    assert screen.stdout.getvalue() == b"The capital of France is the capital of the country.\n"


def test_a_live_bar_redrawn_mid_text_stays_off_the_text_line():
    screen = Screen()
    term = SharedTerminal(screen.text_stream(), screen)
    term.write("server", b"\rstaging 1/2")          # a live bar: redrawn with \r, its line left open
    term.write("text", b"Hello")
    term.write("server", b"\r\x1b[2Kstaging 2/2\n")
    term.write("text", b" world")
    lines = screen.getvalue().decode().split("\n")
    assert lines == ["\rstaging 1/2", "Hello", "\r\x1b[2Kstaging 2/2", "Hello world"]
    assert screen.stdout.getvalue() == b"Hello world"


def test_relay_copies_a_pipe_until_it_closes():
    screen = Screen()
    term = SharedTerminal(screen.text_stream(), screen)
    r, w = os.pipe()
    with os.fdopen(r, "rb", buffering=0) as pipe:
        reader = threading.Thread(target=term.relay, args=("server", pipe))
        reader.start()
        os.write(w, b"one\n")
        os.write(w, b"two\n")
        os.close(w)
        reader.join(timeout=10)
    assert not reader.is_alive() and screen.getvalue() == b"one\ntwo\n"
