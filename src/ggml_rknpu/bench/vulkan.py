"""The Vulkan side of ``rknpu bench model``: the pinned llama.cpp built with ggml-vulkan
(``scripts/build-llama-cpp --vulkan``) on a Vulkan device, the board's Mali GPU, or on a
machine without one a software device such as Mesa's lavapipe ("llvmpipe"), labelled software.

Why the device is chosen here: ggml-vulkan takes GPUs only and skips CPU-type devices unless
``GGML_VK_VISIBLE_DEVICES`` names one, and with no device ``-ngl 99`` runs on ggml-cpu and
llama-bench still succeeds, which would pass the CPU's rates off as the GPU's."""

from __future__ import annotations

import re
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

from ggml_rknpu.toolchain import launch, llamacpp

SIDE = "Vulkan"
VISIBLE_ENV = "GGML_VK_VISIBLE_DEVICES"     # ggml-vulkan: the physical devices it may use, by index
# Mesa's llvmpipe/lavapipe: its worker threads (default: every core); a software device gets the
# CPU side's thread count, so both sides use the same cores
SOFTWARE_THREADS_ENV = "LP_NUM_THREADS"
# common_print_available_devices (llama.cpp common/arg.cpp): "  Vulkan0: NAME (TOTAL MiB, FREE MiB free)"
_DEVICE_LINE = re.compile(r"^\s+(Vulkan\d+): (.+) \(\d+ MiB, \d+ MiB free\)$", re.MULTILINE)
# common_perf_print's decode line (the prompt's is "prompt eval time"): one run per decode pass
_EVAL = re.compile(r"common_perf_print:\s+eval time =\s*[\d.]+ ms /\s*(\d+) runs")


@dataclass(frozen=True)
class VulkanDevice:
    """A Vulkan device as ggml-vulkan names it. ``software``: a CPU-type device (its rates measure
    this host's CPU through a Vulkan driver, not a GPU); ``env`` selects it for every run."""
    name: str
    description: str
    software: bool
    env: dict[str, str] = field(default_factory=dict)

    @property
    def label(self) -> str:
        return self.description + (" - software Vulkan on this host's CPU, not a GPU" if self.software else "")


def _run(tool: Path, client: str, argv: list[str], env: dict[str, str], prefix: list[str], timeout: float
         ) -> subprocess.CompletedProcess[str]:
    # a random or small model prints bytes that are no UTF-8: kept visible and distinct, as \xNN
    return subprocess.run([*prefix, str(tool), *argv], capture_output=True, encoding="utf-8",
                          errors="backslashreplace", timeout=timeout, stdin=subprocess.DEVNULL,
                          env=launch.tool_env(tool.name, client, **env))


def list_devices(tool: Path, env: dict[str, str], timeout: float) -> list[tuple[str, str]]:
    """(name, description) of the Vulkan devices ggml-vulkan offers under ``env``."""
    proc = _run(tool, llamacpp.VULKAN, ["--list-devices"], env, [], timeout)
    if proc.returncode != 0:
        if "Invalid Vulkan device index" in proc.stderr:         # VISIBLE_ENV named a device that is not there
            return []
        raise RuntimeError(f"{tool.name} --list-devices failed ({proc.returncode}):\n{proc.stderr[-2000:]}")
    return _DEVICE_LINE.findall(proc.stdout)


def find_device(threads: int, timeout: float) -> VulkanDevice | str:
    """The device the Vulkan side runs on, or why there is none (no Vulkan build, no device).
    A GPU when ggml-vulkan offers one; else the first physical device, which is then CPU-type
    (ggml-vulkan offers every other type by itself)."""
    try:
        tool = llamacpp.tool("llama-bench", llamacpp.VULKAN)
        llamacpp.tool("llama-completion", llamacpp.VULKAN)
    except llamacpp.LlamaCppNotBuilt as exc:
        return f"no Vulkan build ({exc})"
    gpus = list_devices(tool, {}, timeout)
    if gpus:
        return VulkanDevice(*gpus[0], software=False)
    env = {VISIBLE_ENV: "0", SOFTWARE_THREADS_ENV: str(threads)}
    software = list_devices(tool, env, timeout)
    if software:
        return VulkanDevice(*software[0], software=True, env=env)
    return ("no Vulkan device: the loader found neither a GPU driver nor a software device "
            "(Debian: mesa-vulkan-drivers, which scripts/build-llama-cpp --vulkan installs)")


def greedy_text(client: str, model: Path, prompt: str, n_predict: int, threads: int, extra: list[str],
                env: dict[str, str], prefix: list[str], timeout: float) -> tuple[str, int]:
    """``llama-completion``'s greedy text for ``prompt`` from a build (``llamacpp.PINNED`` or
    ``llamacpp.VULKAN``) and its decode passes (the ``eval time`` line's runs)."""
    tool = llamacpp.tool("llama-completion", client)
    argv = ["-m", str(model), "-p", prompt, "-n", str(n_predict), "-t", str(threads), "-c", "512", "--temp", "0",
            "--seed", "1", "-no-cnv", "--no-display-prompt", "--ignore-eos", *extra]
    proc = _run(tool, client, argv, env, prefix, timeout)
    if proc.returncode != 0:
        raise RuntimeError(f"llama-completion ({client}) failed ({proc.returncode}): {' '.join(argv)}\n"
                           f"{proc.stderr[-3000:]}")
    m = _EVAL.search(proc.stderr)
    if not m:
        raise RuntimeError(f"llama-completion ({client}) printed no eval time line:\n{proc.stderr[-2000:]}")
    return proc.stdout.strip(), int(m.group(1))
