"""ggml's log messages (``ggml_log_set``) routed into Python logging, logger ``ggml_rknpu.ggml``.

Why: ggml's default callback writes every level to stderr, debug included, so each weight
ggml-cpu repacks would print a line into the server's console (and the demo's). Routed, its
debug lines show only under ``--log-level debug`` and its warnings and errors stay visible.
Levels are ``enum ggml_log_level`` (ggml.h); a CONT message continues the previous one."""

from __future__ import annotations

import ctypes
import logging
from typing import TYPE_CHECKING, TypeAlias

log = logging.getLogger("ggml_rknpu.ggml")

# enum ggml_log_level (ggml.h) -> Python logging level
LEVELS = {0: logging.INFO, 1: logging.DEBUG, 2: logging.INFO, 3: logging.WARNING, 4: logging.ERROR}
GGML_LOG_LEVEL_CONT = 5

if TYPE_CHECKING:
    LogCallback: TypeAlias = ctypes._CFunctionType
else:
    LogCallback = ctypes.CFUNCTYPE(None, ctypes.c_int, ctypes.c_char_p, ctypes.c_void_p)   # ggml_log_callback


class GgmlLog:
    """The callback ggml calls; keeps the level of the last message for CONT lines."""

    def __init__(self) -> None:
        self._level = logging.INFO
        self.callback = LogCallback(self._emit)   # referenced here for as long as ggml may call it

    def _emit(self, level: int, text: bytes | None, _user: int | None) -> None:
        if level != GGML_LOG_LEVEL_CONT:
            self._level = LEVELS.get(level, logging.INFO)
        message = (text or b"").decode(errors="replace").rstrip("\n")
        if message and log.isEnabledFor(self._level):
            log.log(self._level, "%s", message)
