"""Test-side helpers for the NPU simulator tests, written independently of the compiler:
a numpy-backed DeviceMemory, the native-layout pack/unpack of npu-programming.md §6 (by
the formulas, not by importing ggml_rknpu.compiler), and the vendor submit sequence of §3."""

from __future__ import annotations

import numpy as np

from ggml_rknpu.hw.regcmd import fetch_amount
from ggml_rknpu.sim.memory import DmaFault
from ggml_rknpu.sim.npu import SimNpu

REGCMD_ADDR = 0x4000_0000


class FakeMemory:
    """Buffers at fixed IOVAs; a view outside any one buffer raises DmaFault, as in ``SimNpu``."""

    def __init__(self) -> None:
        self.buffers: dict[int, np.ndarray] = {}

    def map(self, iova: int, nbytes: int) -> np.ndarray:
        buf = np.zeros(nbytes, dtype=np.uint8)
        self.buffers[iova] = buf
        return buf

    def view(self, iova: int, nbytes: int) -> np.ndarray:
        for base, buf in self.buffers.items():
            if base <= iova and iova + nbytes <= base + buf.size:
                return buf[iova - base : iova - base + nbytes]
        raise DmaFault(iova, nbytes, "test memory: not inside one mapped buffer")


# --- native layouts, element formulas of npu-programming.md §6 ---------------------------
def pack_feature(a_mk: np.ndarray, c2: int) -> np.ndarray:
    """A[M,K] -> NC1HWC2 (K/C2, M, C2): element (m,k) at (k/C2)*M*C2 + m*C2 + k%C2."""
    m, k = a_mk.shape
    return np.ascontiguousarray(a_mk.reshape(m, k // c2, c2).transpose(1, 0, 2)).reshape(-1)


def pack_weights(b_nk: np.ndarray, group: int) -> np.ndarray:
    """B as N kernels of K: (N/G, K/32, G, 32): (n/G)*G*K + (k/32)*G*32 + (n%G)*32 + k%32."""
    n, k = b_nk.shape
    return np.ascontiguousarray(
        b_nk.reshape(n // group, group, k // 32, 32).transpose(0, 2, 1, 3)).reshape(-1)


def unpack_output(flat: np.ndarray, m: int, n: int, c2: int, plane_elems: int | None = None) -> np.ndarray:
    """NC1HWC2 (N/C2, planes of plane_elems, C2) -> C[M,N]."""
    plane_elems = plane_elems if plane_elems is not None else m * c2
    planes = flat[: (n // c2) * plane_elems].reshape(n // c2, plane_elems)[:, : m * c2]
    return planes.reshape(n // c2, m, c2).transpose(1, 0, 2).reshape(m, n)


def vendor_submit(npu: SimNpu, core: int, regcmd_addr: int, body_words: int, task_number: int,
                  first_int_mask: int = 0x300, last_int_mask: int = 0x300) -> None:
    """The vendor kernel's PC-mode commit for one core [npu-programming.md §3 steps 1-9]."""
    pointer = 0xE + 0x1000_0000 * core
    for offset, value in (
        (0x10, 1), (0x1004, pointer), (0x3004, pointer), (0x10, regcmd_addr),
        (0x14, fetch_amount(body_words)), (0x20, last_int_mask), (0x24, first_int_mask),
        (0x30, (0x6 << 12) | task_number), (0x34, 0), (0x08, 1), (0x08, 0),
    ):
        npu.mmio_write(core, offset, value)


def vendor_irq_fuzz(status: int) -> int:
    """rknpu_irq_handler: widen every set bit to its pair [npu-programming.md §3]."""
    out = 0
    for pair in range(7):
        if status & (3 << (2 * pair)):
            out |= 3 << (2 * pair)
    return out


def fp16_sum_bound(a: np.ndarray, b_nk: np.ndarray) -> np.ndarray:
    """Error allowed against the exact sum of K exact fp16 products accumulated in fp32:
    worst case K * 2^-24 * sum|a*b| (Higham's gamma_K), 1% slack."""
    mag = np.abs(a.astype(np.float32)) @ np.abs(b_nk.astype(np.float32)).T
    return 1.01 * a.shape[1] * 2.0**-24 * mag.astype(np.float64)


def within_fp16_model(got: np.ndarray, a: np.ndarray, b_nk: np.ndarray) -> np.ndarray:
    """Elementwise: does ``got`` match 'fp32 sum within the bound, then one RNE to got's
    dtype'? Rounding is monotonic, so the result lies between the rounded window ends."""
    exact = a.astype(np.float64) @ b_nk.astype(np.float64).T
    bound = fp16_sum_bound(a, b_nk)
    lo = (exact - bound).astype(got.dtype).astype(np.float64)
    hi = (exact + bound).astype(got.dtype).astype(np.float64)
    g = got.astype(np.float64)
    return (g >= lo) & (g <= hi)
