"""NpuDevice over SimKernel through the Syscalls seam: discovery (incl. a fake board that
shows a real-looking /dev/dri/renderD129 named rknpu), buffers, both submit paths."""

from __future__ import annotations

import errno
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from ggml_rknpu.devices import Choice, open_device, resolve
from ggml_rknpu.hw.alignment import ceil_div
from ggml_rknpu.kernel.device import HwTask, Job, NpuDevice, discover
from ggml_rknpu.kernel.errors import NpuError, NpuTimeout
from ggml_rknpu.kernel.rknpu import uapi as rk
from ggml_rknpu.kernel.rknpu.driver import RknpuDriver, RknpuSubmitTable
from ggml_rknpu.sim.kernel import SimKernel
from ggml_rknpu.sim.kernel.rknpu import SimRknpuKernel
from support.kernel_fake_npu import FakeNpu, attach, regcmd_words

pytestmark = pytest.mark.timeout(60)
REPO = Path(__file__).resolve().parents[2]


def sim_device(abi: str, **fake) -> tuple[NpuDevice, SimKernel, FakeNpu]:
    k = SimKernel(abi)
    npu = attach(k, **fake)
    path = k._device_paths()[-1]
    return NpuDevice(k, k.open(path), path, simulated=True), k, npu


def put_regcmd(buf, words: np.ndarray, offset: int = 0) -> None:
    buf.array()[offset : offset + words.nbytes] = words.view(np.uint8)


class FakeBoard(SimRknpuKernel):
    """What HostSyscalls would show on an RK3588 running the vendor kernel: a display
    render node next to the NPU's. The simulated kernel answers the NPU node; opening the
    display node works but its DRM name is not rknpu."""

    def __init__(self) -> None:
        super().__init__("rknpu")
        self.nodes = {"/dev/dri": ["card0", "card1", "renderD128", "renderD129"]}
        self.opened: list[str] = []

    def open(self, path, flags=0):
        self.opened.append(path)
        if path == "/dev/dri/renderD128":
            raise PermissionError(errno.EACCES, "Permission denied")
        return super().open(path, flags)

    def _device_paths(self):
        return ["/dev/dri/renderD129"]


def test_discovery_on_a_board_picks_the_vendor_render_node():
    board = FakeBoard()
    assert discover(board) == [("rknpu", "/dev/dri/renderD129")]
    assert not any("card" in p for p in board.opened)  # only render nodes are probed
    with open_device(None, syscalls=board) as dev:
        assert (dev.kind, dev.path, dev.simulated) == ("rknpu", "/dev/dri/renderD129", False)
        assert isinstance(dev.driver, RknpuDriver)
        info = dev.info()
        assert info.driver_version == "0.9.8" and info.hw_version == 0x46495245 and not info.simulated
        free, total = dev.iova_budget()
        assert free == total == (1 << 32) - 4096
    assert board.stats()["handles"] == 0


def test_asking_for_rocket_on_a_vendor_board_is_a_clear_enodev():
    with pytest.raises(NpuError) as e:
        open_device("rocket", syscalls=FakeBoard())
    assert e.value.errno == errno.ENODEV and "sim-rocket" in str(e.value)


def test_device_path_opens_directly():
    with open_device("/dev/dri/renderD129", syscalls=FakeBoard()) as dev:
        assert dev.kind == "rknpu"
    with pytest.raises(NpuError) as e:
        open_device("/dev/dri/renderD128", syscalls=FakeBoard())
    assert e.value.errno == errno.EACCES and "render/video group" in str(e.value)


def test_auto_with_an_unopenable_node_warns_before_simulating(monkeypatch):
    monkeypatch.delenv("RKNPU_DEVICE", raising=False)
    board = FakeBoard()
    board.nodes = {"/dev/dri": ["renderD128"]}  # only the node we may not open
    with pytest.warns(RuntimeWarning, match="renderD128: Permission denied"):
        dev = open_device(None, syscalls=board)
    assert dev.simulated
    dev.close()


def test_auto_without_hardware_falls_back_to_the_simulator(monkeypatch):
    monkeypatch.delenv("RKNPU_DEVICE", raising=False)
    empty = SimKernel("rknpu")
    empty.nodes = {}
    with open_device(None, syscalls=empty) as dev:
        assert (dev.kind, dev.simulated) == ("rknpu", True)


def test_env_overrides_auto(monkeypatch):
    monkeypatch.setenv("RKNPU_DEVICE", "sim-rocket")
    with open_device() as dev:
        assert (dev.kind, dev.simulated) == ("rocket", True)
    with open_device("sim-rknpu") as dev:  # an explicit choice beats the env
        assert dev.kind == "rknpu"


def test_resolve_says_which_device_and_why(monkeypatch):
    """What rknpu demo's last line reports: the device open_device picks here, and the reason."""
    monkeypatch.delenv("RKNPU_DEVICE", raising=False)
    assert resolve(None, syscalls=FakeBoard()) == Choice("rknpu", "/dev/dri/renderD129",
                                                         "/dev/dri/renderD129 is driven by rknpu (found by auto)")
    empty = SimKernel("rknpu")
    empty.nodes = {}
    none = resolve(None, syscalls=empty)
    assert none.simulated and none.why == ("no /dev/dri/renderD* named rknpu and no /dev/accel/accel* named rocket "
                                           "on this machine")
    locked = FakeBoard()
    locked.nodes = {"/dev/dri": ["renderD128"]}
    denied = resolve("auto", syscalls=locked)
    assert denied.simulated and denied.unopenable == ("/dev/dri/renderD128: Permission denied",)
    assert "join the render/video group" in denied.why
    assert resolve("sim-rocket") == Choice("rocket", None, "sim-rocket asked for")
    monkeypatch.setenv("RKNPU_DEVICE", "sim-rocket")
    assert resolve() == Choice("rocket", None, "RKNPU_DEVICE=sim-rocket")
    with pytest.raises(NpuError, match="sim-rocket"):
        resolve("rocket", syscalls=FakeBoard())


def test_unknown_device_name():
    with pytest.raises(NpuError) as e:
        open_device("npu0")
    assert e.value.errno == errno.EINVAL and "sim-rknpu" in str(e.value)


@pytest.mark.parametrize("abi", ["rknpu", "rocket"])
def test_buffers_round_trip_and_close_without_leaks(abi):
    dev, k, _ = sim_device(abi)
    with dev.alloc(10_000) as buf:
        assert buf.dma_addr % 4096 == 0 and buf.dma_addr + buf.capacity <= 1 << 32 and buf.capacity == 12288
        a = buf.array(np.float32)
        assert a.shape == (2500,)
        a[:] = np.arange(2500)
        buf.sync_to_device()
        npu_view = k.address_space(dev.fd).view
        assert np.array_equal(npu_view(buf.dma_addr, 10_000).view(np.float32), np.arange(2500))
        npu_view(buf.dma_addr, 4)[:] = 0  # the NPU writes
        buf.sync_from_device()
        assert a[0] == 0 and a[1] == 1
    assert buf.closed and k.stats()["objects"] == 0
    with pytest.raises(NpuError):
        buf.array()
    leftover = dev.alloc(4096)
    dev.close()
    assert leftover.closed and k.stats()["objects"] == 0


def test_bad_alloc_arguments():
    dev, _, _ = sim_device("rknpu")
    with pytest.raises(NpuError):
        dev.alloc(0)
    with pytest.raises(NpuError):
        dev.alloc(4096, purpose="weights")


def test_vendor_submit_three_cores_core_major_with_subcore_i_plus_2():
    dev, k, npu = sim_device("rknpu")
    regcmd = dev.alloc(4096, purpose="regcmd")
    w1, w2 = regcmd_words(10, next_addr=regcmd.dma_addr + 256, next_body=12), regcmd_words(12)
    put_regcmd(regcmd, w1)
    put_regcmd(regcmd, w2, 256)
    t1, t2 = HwTask(regcmd.dma_addr, 10), HwTask(regcmd.dma_addr + 256, 12)
    out = dev.alloc(4096)
    done = dev.submit(Job(cores=((t1, t2), (t2,), (t1, t2)), outputs=(out,)))
    assert done.task_counter == 5 and done.hw_elapsed_ns is None and done.simulated
    (table,) = dev._tables.values()
    assert isinstance(table, RknpuSubmitTable)
    tasks = (rk.rknpu_task * 5).from_buffer_copy(table.task_bo.view[:200])
    assert [t.regcmd_addr for t in tasks] == [t1.regcmd_addr, t2.regcmd_addr, t2.regcmd_addr,
                                             t1.regcmd_addr, t2.regcmd_addr]
    assert [t.regcfg_amount for t in tasks] == [10, 12, 12, 10, 12]
    assert tasks[0].int_clear == 0x1FFFF
    task_con = {c: v for c, o, v in npu.writes if o == 0x30}
    assert task_con == {0: 0x7002, 1: 0x7001, 2: 0x7002}  # PC|PINGPONG, per-core task counts
    assert [npu.executed_tasks(c) for c in range(3)] == [2, 1, 2]  # the tail chain was followed
    assert (0, 0x14, ceil_div(10 + 4, 2) - 1) in npu.writes and (1, 0x14, ceil_div(12 + 4, 2) - 1) in npu.writes


def test_vendor_submit_two_cores_uses_subcore_task_i():
    dev, k, npu = sim_device("rknpu")
    regcmd = dev.alloc(4096, purpose="regcmd")
    put_regcmd(regcmd, regcmd_words(10))
    t = HwTask(regcmd.dma_addr, 10)
    dev.submit(Job(cores=((), (t,), (t,))))
    assert {c for c, _, _ in npu.writes} == {1, 2}


def test_regcmd_is_cleaned_to_the_device_automatically_but_other_cpu_writes_need_sync():
    def copy_in_to_out(memory, core):  # the "NPU" copies 16 bytes from input to output
        memory.view(state["out"], 16)[:] = memory.view(state["in"], 16)

    state: dict[str, int] = {}
    dev, k, npu = sim_device("rknpu", on_run=copy_in_to_out)
    regcmd, src, dst = dev.alloc(4096, purpose="regcmd"), dev.alloc(4096), dev.alloc(4096)
    state.update({"in": src.dma_addr, "out": dst.dma_addr})
    put_regcmd(regcmd, regcmd_words(10))
    src.array()[:16] = 7
    dev.submit(Job(cores=((HwTask(regcmd.dma_addr, 10),),), inputs=(src,), outputs=(dst,)))
    assert list(dst.array()[:16]) == [7] * 16
    src.array()[:16] = 9  # written, but not listed as an input and not synced
    dev.submit(Job(cores=((HwTask(regcmd.dma_addr, 10),),), outputs=(dst,)))
    assert list(dst.array()[:16]) == [7] * 16  # the NPU still saw the old bytes: a missing sync shows


def test_vendor_hang_raises_npu_timeout_with_diagnostics():
    dev, k, npu = sim_device("rknpu", hang=True)
    regcmd = dev.alloc(4096, purpose="regcmd")
    put_regcmd(regcmd, regcmd_words(10))
    with pytest.raises(NpuTimeout) as e:
        dev.submit(Job(cores=((HwTask(regcmd.dma_addr, 10),),)), timeout_ms=100)
    assert e.value.errno == errno.ETIMEDOUT and "after 100 ms" in str(e.value) and "fake: core 0" in str(e.value)


def test_submit_validates_the_job_before_the_kernel_sees_it():
    dev, _, _ = sim_device("rknpu")
    regcmd = dev.alloc(4096)
    with pytest.raises(NpuError, match="no tasks"):
        dev.submit(Job(cores=((), ())))
    with pytest.raises(NpuError, match="16-byte aligned"):
        dev.submit(Job(cores=((HwTask(regcmd.dma_addr + 8, 10),),)))
    with pytest.raises(NpuError, match="not inside any buffer"):
        dev.submit(Job(cores=((HwTask(0x1000, 10),),)))
    with pytest.raises(NpuError, match="4095"):
        dev.submit(Job(cores=((HwTask(regcmd.dma_addr, 10),) * 4096,)))
    with pytest.raises(NpuError, match="4 cores"):
        dev.submit(Job(cores=((), (), (), (HwTask(regcmd.dma_addr, 10),))))


def test_rocket_submit_one_job_per_core_with_tail_counted():
    dev, k, npu = sim_device("rocket")
    regcmd, out = dev.alloc(4096, purpose="regcmd"), dev.alloc(4096)
    put_regcmd(regcmd, regcmd_words(10))
    t = HwTask(regcmd.dma_addr, 10)
    done = dev.submit(Job(cores=((t, t), (), (t,)), outputs=(out,)))
    assert done.task_counter == 3 and done.hw_elapsed_ns is None
    amounts = [v for _, o, v in npu.writes if o == 0x14]
    assert amounts == [ceil_div(10 + 4, 2) - 1] * 3  # regcmd_count = body + 4
    assert [npu.executed[c] for c in range(3)] == [3, 0, 0]  # two jobs of one file: one core, in turn


def test_rocket_hang_returns_stale_output_without_an_error_as_mainline_does():
    dev, k, npu = sim_device("rocket", hang=True)
    regcmd, out = dev.alloc(4096, purpose="regcmd"), dev.alloc(4096)
    put_regcmd(regcmd, regcmd_words(10))
    out.array()[:] = 0xAB
    out.sync_to_device()
    dev.submit(Job(cores=((HwTask(regcmd.dma_addr, 10),),), outputs=(out,)))   # no error: PREP_BO is 0
    assert (out.array() == 0xAB).all() and any("job timeout" in line for line in k.dmesg)


def test_rocket_hang_surfaces_at_prep_bo_as_timeout_in_loud_mode():
    k = SimKernel("rocket", rocket_errors="loud")
    attach(k, hang=True)
    path = k._device_paths()[-1]
    dev = NpuDevice(k, k.open(path), path, simulated=True)
    regcmd, out = dev.alloc(4096, purpose="regcmd"), dev.alloc(4096)
    put_regcmd(regcmd, regcmd_words(10))
    with pytest.raises(NpuTimeout, match="PREP_BO"):
        dev.submit(Job(cores=((HwTask(regcmd.dma_addr, 10),),), outputs=(out,)))


def test_power_and_reset():
    dev, k, npu = sim_device("rknpu")
    dev.power_on()  # the driver's EINVAL for POWER_ON is expected and swallowed
    assert k.powered
    dev.power_off()   # no case in 0.9.8's rknpu_action: EINVAL, runtime PM decides
    assert k.powered
    dev.reset()
    assert npu.resets == [None]
    rdev, _, _ = sim_device("rocket")
    rdev.power_on()
    with pytest.raises(NpuError) as e:
        rdev.reset()
    assert e.value.errno == errno.EOPNOTSUPP


def test_closed_device_refuses_work():
    dev, _, _ = sim_device("rknpu")
    dev.close()
    dev.close()  # idempotent
    with pytest.raises(NpuError, match="closed"):
        dev.alloc(4096)


# --------------------------------------------------------------------------- rknpu probe
@pytest.mark.parametrize("abi", ["rknpu", "rocket"])
def test_probe_command_on_the_simulator(abi):
    rknpu = [sys.executable, "-m", "ggml_rknpu.cli.main"]
    text = subprocess.run([*rknpu, "probe", "--device", f"sim-{abi}"], capture_output=True, text=True, timeout=60)
    assert text.returncode == 0, text.stderr
    assert "simulated" in text.stdout and "match" in text.stdout and abi in text.stdout
    res = subprocess.run([*rknpu, "probe", "--device", f"sim-{abi}", "--json", "--size", "65536"],
                         capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stderr
    out = json.loads(res.stdout)
    assert out["ok"] is True and out["exit_code"] == 0 and out["interface"] == abi and out["simulated"] is True
    assert out["device"]["driver_name"] == abi and out["device"]["n_cores"] == 3
    assert out["device"]["driver_version"] == ("0.9.8" if abi == "rknpu" else "0.0.0")
    assert (out["device"]["hw_version"] == 0x46495245) == (abi == "rknpu")
    rt = out["round_trip"]
    assert rt["match"] is True and rt["bytes"] == 65536 and rt["mismatched_bytes"] == 0 and rt["dma_addr"] < 1 << 32
    assert out["iova_free_bytes"] == out["iova_total_bytes"] > 0


def test_probe_exit_code_2_for_missing_device():
    res = subprocess.run([sys.executable, "-m", "ggml_rknpu.cli.main", "probe", "--device", "nonsense", "--json"],
                         capture_output=True, text=True, timeout=60)
    assert res.returncode == 2
    out = json.loads(res.stdout)
    assert out["ok"] is False and "choose one of" in out["error"]


def test_probe_exit_code_1_on_mismatch(monkeypatch, capsys):
    """A buffer whose CPU view loses writes (broken mapping) must be reported, not hidden."""
    from ggml_rknpu.cli import probe
    from ggml_rknpu.kernel import device as device_module

    real_sync = device_module.NpuDevice.sync_buffer

    def lossy_sync(self, buf, offset, size, *, to_device):
        real_sync(self, buf, offset, size, to_device=to_device)
        if not to_device:
            buf.array()[:3] ^= 0xFF

    monkeypatch.setattr(device_module.NpuDevice, "sync_buffer", lossy_sync)
    args = type("A", (), {"device": "sim-rknpu", "json": True, "size": 4096})()
    assert probe.run(args) == probe.EXIT_MISMATCH
    out = json.loads(capsys.readouterr().out)
    assert out["round_trip"]["mismatched_bytes"] == 3 and out["ok"] is False


def test_each_submit_table_owns_a_task_bo_of_whole_pages_freed_with_the_table():
    dev, k, npu = sim_device("rknpu")
    regcmd = dev.alloc(4096, purpose="regcmd")
    put_regcmd(regcmd, regcmd_words(10))
    t = HwTask(regcmd.dma_addr, 10)
    objects = k.stats()["objects"]
    dev.submit(Job(cores=((t,),)))
    dev.submit(Job(cores=((t,), (t,), (t,))))
    dev.submit(Job(cores=((t,) * 103,)))  # 103 * 40 bytes > one page
    tables = list(dev._tables.values())
    assert all(isinstance(table, RknpuSubmitTable) for table in tables)
    bos = [table.task_bo for table in tables if isinstance(table, RknpuSubmitTable)]
    assert [bo.capacity for bo in bos] == [4096, 4096, 8192] and len({bo.obj_addr for bo in bos}) == 3
    assert k.stats()["objects"] == objects + 3
    regcmd.close()   # the tables running it go with it, their task BOs too
    assert dev._tables == {} and k.stats()["objects"] == objects - 1
    again = dev.alloc(4096, purpose="regcmd")
    put_regcmd(again, regcmd_words(10))
    dev.submit(Job(cores=((HwTask(again.dma_addr, 10),),)))
    assert len(dev._tables) == 1 and k.stats()["objects"] == objects + 1
    dev.close()


def test_a_replayed_job_reuses_its_submit_table_and_task_array(monkeypatch):
    """Per-token submits are tabled once: same Job.cores -> no rebuild, no task BO rewrite."""
    dev, k, npu = sim_device("rknpu")
    regcmd = dev.alloc(4096, purpose="regcmd")
    put_regcmd(regcmd, regcmd_words(10))
    job = Job(cores=((HwTask(regcmd.dma_addr, 10),), (HwTask(regcmd.dma_addr, 10),)))
    dev.submit(job)
    syncs: list[tuple[int, int, int, bool]] = []
    real = dev.driver.sync

    def counting_sync(allocation, offset, size, *, to_device):
        syncs.append((allocation.handle, offset, size, to_device))
        real(allocation, offset, size, to_device=to_device)

    monkeypatch.setattr(dev.driver, "sync", counting_sync)
    dev.submit(job)
    dev.submit(Job(cores=job.cores))  # an equal job built anew is the same submit table
    # a replayed table: no task BO rewrite and no regcmd clean (both were cleaned when it was built)
    assert syncs == [] and len(dev._tables) == 1
    dev.submit(Job(cores=((HwTask(regcmd.dma_addr, 10),),)))
    new_table = dev._tables[(0, ((HwTask(regcmd.dma_addr, 10),),))]
    assert isinstance(new_table, RknpuSubmitTable)
    assert syncs == [(regcmd.handle, 0, regcmd.size, True), (new_table.task_bo.handle, 0, 40, True)]
    assert len(dev._tables) == 2
    assert [npu.executed_tasks(c) for c in range(3)] == [4, 3, 0]
    regcmd.close()
    with pytest.raises(NpuError, match="not inside any buffer"):
        dev.submit(job)  # the cached table's regcmd buffer is gone: rebuilt and refused
