"""docs/decode-walk.md's call sequences are the code's, and no NPU step is more than
``MAX_FRAMES`` deep: a tiny graph (two MUL_MATs of one activation, grouped, and one of
another, single) replayed on each simulated driver, with the Python frames recorded at each
SUBMIT ioctl, from the GRAPH_COMPUTE handler down (rocket: the same with its driver's frame)."""

from __future__ import annotations

import re
import sys
from pathlib import Path
from types import FrameType

import numpy as np
import pytest

import ggml_rknpu
from ggml_rknpu.kernel.rknpu import uapi
from ggml_rknpu.kernel.rocket import uapi as rocket_uapi
from ggml_rknpu.libggml.enums import GgmlOp
from ggml_rknpu.server.rpc import report
from support.rpc_testkit import T, serve

pytestmark = pytest.mark.timeout(180)
WALK = Path(__file__).resolve().parents[2] / "docs" / "decode-walk.md"
HANDLER = "Session._graph_compute"
MUL_MAT = int(GgmlOp.MUL_MAT)
K, N, M = 64, 96, 1     # N: three fp16 kernel groups at least, a slice per file
MAX_FRAMES = 9          # from the handler to the ioctl, both counted (docs/decode-walk.md)
SUBMIT = {"sim-rknpu": uapi.DRM_IOCTL_RKNPU_SUBMIT, "sim-rocket": rocket_uapi.DRM_IOCTL_ROCKET_SUBMIT}
# the frames that differ by driver: its NpuDriver and its simulated kernel (the page shows rknpu's)
DRIVER_FRAMES = {"sim-rknpu": (("kernel/rknpu/driver.py", "RknpuDriver.submit"),
                               ("sim/kernel/rknpu.py", "SimRknpuKernel.ioctl")),
                 "sim-rocket": (("kernel/rocket/driver.py", "RocketDriver.submit"),
                                ("sim/kernel/rocket.py", "SimRocketKernel.ioctl"))}


def _documented() -> dict[str, list[tuple[str, str]]]:
    blocks = re.findall(r"```decode-walk ([\w-]+)\n(.*?)```", WALK.read_text(), re.S)
    return {name: [tuple(line.split()) for line in body.strip().splitlines()] for name, body in blocks}


def _frames(syscalls: object) -> list[tuple[str, str]]:
    """(file under ggml_rknpu/, qualified name) of every package frame from the handler to the ioctl."""
    frames = []
    f: FrameType | None = sys._getframe(2)          # the caller of the traced ioctl
    while f is not None:
        path = f.f_code.co_filename.replace("\\", "/")
        if "/ggml_rknpu/" in path:
            frames.append((path.rsplit("/ggml_rknpu/", 1)[1], f.f_code.co_qualname))
        f = f.f_back
    frames.reverse()
    names = [q for _, q in frames]
    own = type(syscalls)
    return frames[names.index(HANDLER):] + [(own.__module__.removeprefix("ggml_rknpu.").replace(".", "/") + ".py",
                                             f"{own.__qualname__}.ioctl")]


def _replay_recorded(monkeypatch, npu, submit: int) -> tuple[list[list[tuple[str, str]]], list[np.ndarray], dict]:
    """The tiny graph planned, then replayed once with the frames recorded at each ``submit``
    ioctl: (the frames, the three results checked against numpy, the server's stats)."""
    cls = type(npu.device.syscalls)
    real = cls.ioctl
    recorded: list[list[tuple[str, str]]] = []
    recording = [False]

    def traced(self, fd, request, arg):
        if recording[0] and request == submit:
            recorded.append(_frames(self))
        return real(self, fd, request, arg)

    monkeypatch.setattr(cls, "ioctl", traced)
    rng = np.random.default_rng(0)
    ws = [rng.standard_normal((N, K)).astype(np.float32) for _ in range(3)]
    x, y = (rng.standard_normal((M, K)).astype(np.float32) for _ in range(2))
    with serve(npu=npu) as st:
        with st.client() as c:
            wh, wb = c.alloc_base(3 * N * K * 4)
            ch, cb = c.alloc_base(1 << 16)
            wt = [T(ne=(K, N, 1, 1), buffer=wh, data=wb + i * N * K * 4, name=f"blk.0.w{i}") for i in range(3)]
            xt = T(ne=(K, M, 1, 1), buffer=ch, data=cb, name="x")
            yt = T(ne=(K, M, 1, 1), buffer=ch, data=cb + 4096, name="y")
            q = T(ne=(N, M, 1, 1), buffer=ch, data=cb + 8192, op=MUL_MAT, src=(wt[0].id, xt.id), name="q")
            k = T(ne=(N, M, 1, 1), buffer=ch, data=cb + 12288, op=MUL_MAT, src=(wt[1].id, xt.id), name="k")
            o = T(ne=(N, M, 1, 1), buffer=ch, data=cb + 16384, op=MUL_MAT, src=(wt[2].id, yt.id), name="o")
            for t, w in zip(wt, ws):
                c.set_array(t, w)
            c.set_array(xt, x)
            c.set_array(yt, y)
            tensors = [*wt, xt, yt, q, k, o]
            c.graph_compute([q, k, o], tensors)      # planned and staged
            c.get_array(o)
            recording[0] = True
            c.graph_compute([q, k, o], tensors)      # the decode token: the plan replayed
            got = [c.get_array(t).reshape(M, N) for t in (q, k, o)]
            recording[0] = False
            stats = report.stats_dict(st.state)
    for out, a, w in zip(got, (x, x, y), ws):
        np.testing.assert_allclose(out, a @ w.T, rtol=2e-2, atol=5e-2)
    return recorded, got, stats


@pytest.mark.parametrize("device", sorted(SUBMIT))
def test_the_documented_decode_walk_is_the_call_sequence(monkeypatch, device):
    swap = dict(zip(DRIVER_FRAMES["sim-rknpu"], DRIVER_FRAMES[device], strict=True))
    documented = {name: [swap.get(f, f) for f in frames] for name, frames in _documented().items()}
    assert set(documented) == {"grouped", "single", "core-files"}
    npu = ggml_rknpu.open(device=device)
    try:
        recorded, _, stats = _replay_recorded(monkeypatch, npu, SUBMIT[device])
    finally:
        npu.close()
    assert stats["plan_cache_hits"] == 1 and stats["npu_grouped_runs"] == 2
    assert len(recorded) == 2 and all(len(frames) <= MAX_FRAMES for frames in recorded), \
        [len(frames) for frames in recorded]
    assert recorded == [documented["grouped"], documented["single"]]
    assert f"`MAX_FRAMES` = {MAX_FRAMES} frames" in WALK.read_text()


def test_a_file_per_core_keeps_the_frame_bound(monkeypatch):
    """Mainline rocket with three cores (extended envelope): each step's jobs are launched on
    the three files (one SUBMIT each, the three from three simulated entities), within
    ``MAX_FRAMES`` as documented."""
    npu = ggml_rknpu.open(device="sim-rocket", envelope="extended")
    kernel = npu.device.syscalls
    try:
        before = len(kernel.job_runs)
        recorded, _, stats = _replay_recorded(monkeypatch, npu, rocket_uapi.DRM_IOCTL_ROCKET_SUBMIT)
        runs = kernel.job_runs[before:]
    finally:
        npu.close()
    assert stats["npu_grouped_runs"] == 2 and len(recorded) == 2 * 3          # two steps, three files each
    assert all(len(frames) <= MAX_FRAMES for frames in recorded), [len(frames) for frames in recorded]
    documented = _documented()["core-files"]
    assert recorded[::3] == [[("server/plan_steps.py", "NpuGroup.run") if f == ("server/plan_steps.py", "NpuStep.run")
                              else f for f in documented], documented]
    assert len({r.entity for r in runs}) == 3
