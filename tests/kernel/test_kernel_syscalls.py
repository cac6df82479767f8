"""HostSyscalls on the machine's own kernel (a temp file stands in for a device node), and
both implementations satisfying the one Syscalls interface."""

from __future__ import annotations

import errno

import numpy as np
import pytest

from ggml_rknpu.kernel import drm
from ggml_rknpu.kernel.syscalls import HostSyscalls, Syscalls
from ggml_rknpu.sim.kernel import SimKernel


def test_both_implementations_are_syscalls():
    assert isinstance(HostSyscalls(), Syscalls)
    assert isinstance(SimKernel("rknpu"), Syscalls) and isinstance(SimKernel("rocket"), Syscalls)


def test_host_open_mmap_munmap_close(tmp_path):
    path = tmp_path / "node"
    path.write_bytes(bytes(8192))
    host = HostSyscalls()
    fd = host.open(str(path))
    try:
        with pytest.raises(OSError) as e:
            host.mmap(fd, 8192, 4096)  # past the end of the file
        assert e.value.errno == errno.EINVAL
        view = host.mmap(fd, 4096, 4096)
        arr = np.frombuffer(view, np.uint8)
        arr[:4] = [1, 2, 3, 4]
        host.munmap(view)  # arr still alive: the mapping is released when it goes
        del arr
        with pytest.raises(OSError) as e:
            host.munmap(view)
        assert e.value.errno == errno.EINVAL
    finally:
        host.close(fd)
    assert path.read_bytes()[4096:4100] == b"\x01\x02\x03\x04"  # MAP_SHARED wrote through


def test_host_ioctl_on_a_plain_file_is_enotty(tmp_path):
    path = tmp_path / "node"
    path.write_bytes(b"")
    host = HostSyscalls()
    fd = host.open(str(path))
    try:
        with pytest.raises(OSError) as e:
            host.ioctl(fd, drm.DRM_IOCTL_VERSION, bytearray(64))
        assert e.value.errno == errno.ENOTTY
    finally:
        host.close(fd)


def test_host_listdir_exists_read_text(tmp_path):
    host = HostSyscalls()
    (tmp_path / "b").write_text("x")
    (tmp_path / "a").write_text("y")
    assert host.listdir(str(tmp_path)) == ["a", "b"]
    assert host.listdir(str(tmp_path / "missing")) == []
    assert host.exists(str(tmp_path / "a")) and not host.exists(str(tmp_path / "c"))
    assert host.read_text(str(tmp_path / "b")) == "x"
