"""The stack on arm64, inside the emulated Cortex-A76 root of ``scripts/arm64-env``
(``scripts/arm64-env run scripts/test -m arm64``; docs/arm64.md).

What only an aarch64 process can show: ggml-cpu sees the A76's features (NEON, dotprod, fp16
arithmetic; no i8mm, no SVE), so it picks the kernels and repacked layouts an RK3588's big cores
get; llama.cpp's test-backend-ops passes against ``rknpu serve`` for the ops whose ARM kernels
differ from x86's (the client's CPU backend, the judge, is the aarch64 ggml-cpu too); greedy text
of tiny Q4_0 and Q8_0 models through the arm64 server equals the arm64 CPU-only run, whose
weights ggml-cpu repacks (Q4_0 into q4_0_4x4 on a dotprod core); and the board kit a first
board owner types runs. The marker ``arm64`` also selects other modules' tests (tests/conftest.py).
"""

from __future__ import annotations

import ctypes
import importlib.util
import json
import os
import platform
import subprocess
import sys
from pathlib import Path

import pytest

from ggml_rknpu.toolchain import llamacpp, llamacpp_wheel
from support.e2e_support import Server, completion, rknpu_server, run_backend_ops, tool_env, tool_or_skip
from support.gguf_models import write_tiny_gguf

needs_arm64 = pytest.mark.skipif(
    platform.machine() != "aarch64",
    reason=f"not an aarch64 process ({platform.machine()}): runs inside the arm64 root, "
           "scripts/arm64-env run scripts/test -m arm64")
pytestmark = [pytest.mark.arm64, needs_arm64]

RIGS = Path(__file__).resolve().parents[1] / "fixtures" / "rigs"
PROMPT = "The capital of France is"

# ggml_cpu_has_<name>() of libggml-cpu (ggml-cpu.h) on a Cortex-A76: Armv8.2-A with the dot
# product and half-precision extensions, without the int8 matrix multiply (Armv8.6) and SVE
# (Arm Cortex-A76 Technical Reference Manual, "Implementation options" / ID_AA64ISAR0_EL1,
# ID_AA64PFR0_EL1 fields; docs/arm64.md).
A76_GGML_FEATURES = {"neon": 1, "arm_fma": 1, "dotprod": 1, "fp16_va": 1, "matmul_int8": 0, "sve": 0, "sme": 0}
# AT_HWCAP / AT_HWCAP2 bits the kernel hands an A76 process (Linux arch/arm64/include/uapi/asm/hwcap.h)
HWCAP_BITS = {"fphp": 9, "asimdhp": 10, "asimddp": 20, "sve": 22}
HWCAP2_I8MM = 13
A76_HWCAP = {"fphp": True, "asimdhp": True, "asimddp": True, "sve": False}


def test_ggml_cpu_sees_the_a76s_features(host_ggml) -> None:
    """The features ggml-cpu detects at run time (getauxval) are the A76's: its dispatch, and the
    repack type for each weight (repack.cpp ggml_repack_get_optimal_repack_type), follow from them."""
    cpu = ctypes.CDLL(str(llamacpp.ggml_library_dir() / "libggml-cpu.so"))
    got = {name: int(getattr(cpu, f"ggml_cpu_has_{name}")()) for name in A76_GGML_FEATURES}
    assert got == A76_GGML_FEATURES


def test_the_emulated_core_advertises_the_a76s_hwcaps() -> None:
    """qemu-user hands the process the emulated CPU's AT_HWCAP (QEMU_CPU=cortex-a76), the same
    bits an RK3588's kernel gives an A76 process; /proc/cpuinfo inside the root is the host's."""
    # the whole environment: a child without QEMU_CPU would run on qemu's default core ("max",
    # which has SVE and i8mm)
    out = subprocess.run(["/bin/true"], env={**os.environ, "LD_SHOW_AUXV": "1"}, capture_output=True, text=True,
                         check=True).stdout
    aux = dict(line.split(":", 1) for line in out.splitlines() if ":" in line)
    hwcap, hwcap2 = int(aux["AT_HWCAP"].strip(), 16), int(aux["AT_HWCAP2"].strip(), 16)
    assert {name: bool(hwcap >> bit & 1) for name, bit in HWCAP_BITS.items()} == A76_HWCAP, hex(hwcap)
    assert not hwcap2 >> HWCAP2_I8MM & 1, hex(hwcap2)


# op -> -p filter: the ops whose ggml-cpu kernels on ARM differ from x86's (NEON/dotprod/fp16
# paths), the weight types for which ggml-cpu has ARM repack layouts, in the cases of
# test_e2e_backend_ops' CI subset.
ARM64_CASES: dict[str, str | None] = {
    "MUL_MAT": r"^type_a=(q4_0|q4_K|q8_0|iq4_nl),type_b=f32,m=16,n=(1|9),k=256,bs=\[(1,1|2,3)\],"
               r"nr=\[1,1\],per=\[0,1,2,3\]",
    "MUL_MAT_ID": r"^type_a=(q4_0|q4_K|q8_0|iq4_nl),type_b=f32,n_mats=4,n_used=(1|2),b=(0|1),m=512,n=(1|32),k=256",
    "FLASH_ATTN_EXT": r"^hsk=(64|128),hsv=(64|128),nh=4,nr23=\[(1|4),1\],kv=113,nb=(1|3),mask=1,sinks=0,"
                      r"max_bias=0\.0+,logit_softcap=(0|10)\.0+,prec=f32,type_K=f16,type_V=f16,permute=\[0,1,2,3\]",
    "ROPE": r"^type=f32,ne_a=\[(128,32|64,8),2,1\],n_dims=(128|64),mode=(0|2),n_ctx=512,fs=1\.0+,ef=(0\.0+|0\.7465)",
    "RMS_NORM": None,
    "GET_ROWS": r"^type=(f32|f16|q8_0|q4_0|q4_K|q6_K),n=256,m=5,r=4,be1=1,be2=1,v=0",
    "SET_ROWS": r"^type_src=f32,type_dst=(f16|q8_0|q4_0|q4_K|iq4_nl),",
    "CPY": r"^type_src=f32,type_dst=(f16|q8_0|q4_0|q4_K|iq4_nl),",
}


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory):
    tool_or_skip("test-backend-ops")
    with rknpu_server(tmp_path_factory.mktemp("arm64-backend-ops")) as srv:
        yield srv


@pytest.mark.llama
@pytest.mark.timeout(1800)
@pytest.mark.parametrize("op", sorted(ARM64_CASES))
def test_backend_ops_against_the_server(server: Server, op: str) -> None:
    result = run_backend_ops(server.endpoint, op, ARM64_CASES[op], timeout=1700)
    print(f"\ntest-backend-ops -b RPC0 -o {op}: {result.passed}/{result.total} passed ({platform.machine()})")
    assert result.total > 0 and result.passed == result.total and result.backend_ok, \
        f"{result.summary()}\n{result.output[-4000:]}\n--- server log ---\n{server.log()}"
    assert server.alive(), server.log()


@pytest.mark.llama
@pytest.mark.timeout(1800)
@pytest.mark.parametrize("wtype", ["q4_0", "q8_0"])
def test_quantized_tiny_model_greedy_equals_cpu(tmp_path: Path, wtype: str) -> None:
    """A tiny llama with Q4_0 / Q8_0 weights: the CPU-only run repacks them (ggml-cpu's CPU_REPACK
    buffer: q4_0_4x4 on a dotprod core without i8mm, the A76) and multiplies with the ARM
    kernels; through the server the weights are on the NPU with activations rounded as ggml-cpu
    rounds them (``--activations ggml``). Same greedy text."""
    tool_or_skip("llama-completion")
    model = write_tiny_gguf(tmp_path / f"tiny-llama-{wtype}.gguf", "llama", wtype)
    cpu_text, cpu = completion(model, PROMPT, n_predict=12, timeout=900)
    assert cpu.returncode == 0, cpu.stderr[-3000:]
    with rknpu_server(tmp_path, extra=("--weights", "fp16", "--activations", "ggml")) as srv:
        text, proc = completion(model, PROMPT, n_predict=12, rpc=srv.endpoint, timeout=900)
        assert proc.returncode == 0, f"{proc.stderr[-3000:]}\n--- server ---\n{srv.log()}"
    assert srv.weight_uploads() > 0, srv.log()
    assert cpu_text.strip() and text == cpu_text, f"RPC {text!r} != CPU {cpu_text!r}"


# --- the board kit: what a first board owner types -----------------------------------------------

def _rknpu(*args: str, timeout: float = 600) -> subprocess.CompletedProcess[str]:
    # a tiny random model's text is not valid UTF-8
    return subprocess.run([sys.executable, "-m", "ggml_rknpu.cli.main", *args], capture_output=True, text=True,
                          errors="replace", timeout=timeout, env=tool_env())


@pytest.mark.timeout(600)
def test_probe_on_the_simulator() -> None:
    proc = _rknpu("probe", "--device", "sim-rknpu", "--json")
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout)
    assert out["ok"] and out["simulated"] and out["round_trip"]["match"], out


@pytest.mark.timeout(600)
def test_check_rig_on_a_healthy_board_tree() -> None:
    proc = _rknpu("check-rig", "--root", str(RIGS / "healthy"), "--json")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads(proc.stdout)
    assert report["verdict"] == "PASS" and report["on_board"], report


@pytest.mark.llama
@pytest.mark.timeout(1800)
def test_demo_with_a_tiny_model(tmp_path: Path) -> None:
    tool_or_skip("llama-completion")
    model = write_tiny_gguf(tmp_path / "tiny-llama-f16.gguf", "llama", "f16")
    log = tmp_path / "server.log"
    proc = _rknpu("demo", "--device", "sim-rknpu", "-m", str(model), "-n", "8", "--server-log", str(log),
                  timeout=1700)
    assert proc.returncode == 0, f"{proc.stderr[-3000:]}\n--- server ---\n{log.read_text()[-3000:]}"
    text = proc.stdout.strip()   # the tiny vocabulary's SPM pieces start with a space
    assert text.startswith(PROMPT) and len(text) > len(PROMPT), proc.stdout
    assert "uploads" in log.read_text(), log.read_text()[-3000:]
    # the demo's last line: where the server ran, and why
    assert proc.stderr.splitlines()[-1] == "demo: ran on the NPU simulator on this CPU: sim-rknpu asked for", \
        proc.stderr[-3000:]


def test_the_protocol8_client_is_left_out_naming_why() -> None:
    """llama-cpp-py-sync has no aarch64 wheel: set-up left it out (pyproject.toml's marker), and the
    protocol-8 tests skip on the reason ``client()`` gives."""
    assert importlib.util.find_spec(llamacpp_wheel.PACKAGE) is None
    with pytest.raises(llamacpp_wheel.WheelUnavailable, match=r"has no wheel for this machine \(aarch64\): "
                       "pyproject.toml installs it only where .*platform_machine == \"x86_64\""):
        llamacpp_wheel.client()
