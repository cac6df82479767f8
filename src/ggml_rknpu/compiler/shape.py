"""A matmul's shape and precisions, validated once, with the padded sizes every other
compiler module derives from it.

C[M, N] = A[M, K] . B[K, N] runs as a 1x1 convolution: A is a feature map H=M, W=1, C=K;
B is N kernels of 1x1xK; C is a feature map H=M, W=1, C=N [docs/npu-programming.md §6].
"""

from __future__ import annotations

from dataclasses import dataclass

from ggml_rknpu.hw import limits
from ggml_rknpu.hw.alignment import align_up

# (input precision, output precision) pairs the compiler emits; all three are the
# hardware-validated MTX modes [tests/data/oracle/README.md; docs/npu-programming.md §7, §12].
SUPPORTED_MODES: frozenset[tuple[str, str]] = frozenset(
    {("fp16", "fp32"), ("fp16", "fp16"), ("int8", "int32")}
)


@dataclass(frozen=True)
class MatmulShape:
    M: int
    K: int
    N: int
    dtype: str = "fp16"   # A and B precision: "fp16" | "int8"
    out: str = "fp32"     # C precision: "fp32" | "fp16" (fp16 in) | "int32" (int8 in)

    def __post_init__(self) -> None:
        for name in ("M", "K", "N"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"matmul {name} must be a positive int, got {v!r}")
        if (self.dtype, self.out) not in SUPPORTED_MODES:
            raise ValueError(
                f"unsupported matmul precision {self.dtype} -> {self.out}; supported: "
                + ", ".join(f"{i}->{o}" for i, o in sorted(SUPPORTED_MODES))
            )

    @property
    def in_bytes(self) -> int:
        return limits.BYTES[self.dtype]

    @property
    def kernel_group(self) -> int:
        """Kernels per weight group: 16 fp16, 32 int8 [TRM CONV_CON2; §1]."""
        return limits.KERNEL_GROUP[self.dtype]

    @property
    def Kp(self) -> int:
        """K padded to the 32-channel MAC atom [§6]."""
        return align_up(self.K, limits.K_ALIGN)

    @property
    def Np(self) -> int:
        """N padded to the kernel group; padding kernels are zero [§6, §10]."""
        return align_up(self.N, self.kernel_group)

    @property
    def c2_in(self) -> int:
        return limits.c2(self.dtype)
