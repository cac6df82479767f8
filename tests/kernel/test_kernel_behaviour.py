"""The kernel-behaviour table (kernel/behaviour.py) against both simulated kernels: every row,
harmless or not, answers as the upstream source says; a kernel that answers otherwise is
reported row by row (what ``rknpu selftest`` prints on a board)."""

from __future__ import annotations

import errno

import pytest

from ggml_rknpu.kernel.behaviour import TABLE, run_table
from ggml_rknpu.kernel.rknpu import uapi as rk
from ggml_rknpu.sim.kernel import SimKernel, SimRknpuKernel

NODES = {"rknpu": "/dev/dri/renderD129", "rocket": "/dev/accel/accel0"}


@pytest.mark.parametrize("abi", ["rknpu", "rocket"])
def test_every_row_holds_on_the_simulated_kernel(abi):
    k = SimKernel(abi)
    fd = k.open(NODES[abi])
    n, disagreements = run_table(k, fd, abi, k.driver_version, harmless_only=False)
    assert n == sum(r.abi == abi and r.version in (None, k.driver_version) for r in TABLE) and n >= 6
    assert [d.describe() for d in disagreements] == []
    assert k.stats()["objects"] == 0          # every probe frees what it made


def test_rows_name_their_upstream_source_and_board_safety():
    assert all(r.source and r.given and isinstance(r.harmless, bool) for r in TABLE)
    assert {r.ioctl for r in TABLE if not r.harmless} == {"ACTION", "SUBMIT"}   # POWER_OFF, an uncommitted mask


class _KindKernel(SimRknpuKernel):
    """The simulated vendor kernel with the old, kinder answers to POWER_ON and MEM_MAP."""

    def ioctl(self, fd: int, request: int, arg: bytearray) -> int:
        if request == rk.DRM_IOCTL_RKNPU_ACTION and rk.rknpu_action.from_buffer(arg).flags == rk.Action.POWER_ON:
            return 0
        if request == rk.DRM_IOCTL_RKNPU_MEM_MAP:
            raise OSError(errno.EINVAL, "bad handle")
        return super().ioctl(fd, request, arg)


def test_a_kernel_that_answers_otherwise_is_reported_row_by_row():
    k = _KindKernel("rknpu")
    n, disagreements = run_table(k, k.open(NODES["rknpu"]), "rknpu", k.driver_version, harmless_only=True)
    assert sorted((d.row.ioctl, d.got) for d in disagreements) == [("ACTION", 0), ("MEM_MAP", errno.EINVAL)]
    assert any(f"expected {errno.EINVAL}, the kernel gave 0" in d.describe() for d in disagreements)
