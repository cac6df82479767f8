"""``rknpu serve`` whose every MEM_SYNC asks for a page more than its range: a misuse the
simulated vendor kernel clamps and records (``sim.kernel.misuse``), as a board's driver
would let it pass. For the test that a subprocess server's misuses reach the test.

Usage: ``python serve_misusing.py serve ...`` (the serve arguments follow).
"""

from __future__ import annotations

import sys

from ggml_rknpu.hw.limits import PAGE_BYTES
from ggml_rknpu.kernel.rknpu.ioctls import RknpuIoctls


def main() -> int:
    real = RknpuIoctls.mem_sync_call

    def past_the_end(self, obj_addr, offset, size, flags):
        return real(self, obj_addr, offset, size + PAGE_BYTES, flags)

    RknpuIoctls.mem_sync_call = past_the_end   # type: ignore[method-assign]
    from ggml_rknpu.cli.main import main as rknpu_main
    return rknpu_main(sys.argv[1:])


if __name__ == "__main__":
    sys.exit(main())
