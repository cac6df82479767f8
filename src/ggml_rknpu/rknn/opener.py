"""Opening the rknn engine for ``rknpu serve --engine rknn`` and ``rknpu bench --engines rknn``:
one place for the library lookup, the device rule and the start-up probe.

Invariants: librknnrt opens the vendor ``rknpu`` driver itself, so the library must be
found (else ``RknnUnavailable`` says how to install it) and a vendor node must be present,
unless ``$LIBRKNNRT_PATH`` is set explicitly (the user vouches: the test stand-in, or an
unrecognised board); a start-up probe creates and destroys one tiny context, so a runtime
that cannot reach its device fails at start, not mid-serving. The stand-in is recognised
by ``binding.STANDIN_MARKER``, and reports then say "stand-in"."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from ggml_rknpu.rknn import binding as rb
from ggml_rknpu.rknn.engine import RknnEngine

CORE_MASK_FOR_CORES = {1: "core0", 2: "core0_1", 3: "core0_1_2"}   # rknn_core_mask [docs/rknn-toolkit.md §4.2]


class RknnRefused(RuntimeError):
    """The rknn engine cannot be used here (no board, wrong --device); the message says why."""


@dataclass(frozen=True)
class RknnSetup:
    """What the rknn engine runs on: which library, whether it is the test stand-in, which NPU node."""

    library: Path
    standin: bool
    board_node: str | None   # the vendor rknpu node found, None off a board

    @property
    def on_board(self) -> bool:
        """The real runtime on a real NPU: only then are its wall times NPU figures."""
        return self.board_node is not None and not self.standin

    def describe(self) -> str:
        if self.standin:
            return f"rknn engine through the TEST STAND-IN {self.library} (no NPU; host C code)"
        return f"rknn engine (librknnrt {self.library}) on {self.board_node or 'a device the runtime opens itself'}"

    def as_dict(self) -> dict:
        return {"library": str(self.library), "standin": self.standin, "board_node": self.board_node,
                "on_board": self.on_board}


def vendor_node() -> str | None:
    """The first ``/dev/dri/renderD*`` driven by the vendor ``rknpu`` driver, None if there is none."""
    from ggml_rknpu.kernel.device import discover
    from ggml_rknpu.kernel.syscalls import HostSyscalls

    nodes = [path for kind, path in discover(HostSyscalls()) if kind == "rknpu"]
    return nodes[0] if nodes else None


def probe(lib: rb.RknnLibrary) -> None:
    """Create and destroy the smallest fp16 context (M=1, K=32, N=16 [§4.4 alignment])."""
    ctx, _io = lib.matmul_create(rb.MatmulInfo(M=1, K=32, N=16, type=rb.FLOAT16_MM_FLOAT16_TO_FLOAT32))
    lib.matmul_destroy(ctx)


def load(device: str = "auto") -> tuple[rb.RknnLibrary, RknnSetup]:
    """Apply the module's rule; raise ``RknnUnavailable`` (no library), ``RknnRefused`` (no
    board / wrong device) or ``RknnError`` (the probe failed)."""
    if device not in ("auto", "rknpu"):
        raise RknnRefused(f"--device {device} cannot run the rknn engine: librknnrt drives the vendor rknpu "
                          "driver itself (use --device auto or rknpu, or --engine ours for the simulator/rocket)")
    lib = rb.RknnLibrary()
    node = vendor_node()
    explicit = bool(os.environ.get("LIBRKNNRT_PATH"))
    if node is None and not explicit:
        raise RknnRefused(f"{lib.path} found, but no /dev/dri/renderD* driven by the vendor rknpu driver: "
                          "librknnrt needs an RK3588 board with the rknpu driver loaded (and you in the "
                          "render/video group). Set LIBRKNNRT_PATH explicitly to use this library anyway.")
    probe(lib)
    return lib, RknnSetup(lib.path, lib.is_standin, node)


def open_rknn(device: str = "auto", *, max_contexts: int = 32, cores: int | None = None,
              loaded: tuple[rb.RknnLibrary, RknnSetup] | None = None) -> tuple[RknnEngine, RknnSetup]:
    """``load`` (unless ``loaded`` is given), then an engine; ``cores`` 1-3 pins that many cores
    (None: the runtime's automatic choice)."""
    lib, setup = loaded or load(device)
    if cores is not None and cores not in CORE_MASK_FOR_CORES:
        raise ValueError(f"cores must be one of {sorted(CORE_MASK_FOR_CORES)}, got {cores}")
    mask = "auto" if cores is None else CORE_MASK_FOR_CORES[cores]
    return RknnEngine(lib, max_contexts=max_contexts, core_mask=mask), setup
