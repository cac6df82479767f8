"""Hardware limits and constants that tiling, emission and simulation depend on.

Each constant cites its source. Field-width limits are derived from the register
database (``registers.py``), never restated as magic numbers.
"""

from __future__ import annotations

from ggml_rknpu.hw.registers import REGISTERS


def _field_max(register: str, field: str) -> int:
    return REGISTERS[register].field(field).max_value


# --- Cores and CBUF --------------------------------------------------------------------
N_CORES = 3                     # [TRM 36.1; docs/npu-programming.md §1; VEND core_mask 0x7]
CBUF_BANKS = 12                 # [MESA rkt_ml.h; MTX npu_hw.h; TRM "384KB"; §1]
CBUF_BANK_BYTES = 32 * 1024     # [§1]
CBUF_ENTRY_BYTES = 128          # 256 entries x 128 B per bank [§1]
CBUF_ENTRIES_PER_BANK = 256     # [§1]
MAX_DATA_BANKS = CBUF_BANKS - 1  # DATA_BANK + WEIGHT_BANK = 12, weights need >= 1 bank [§7, §9]
MIN_WEIGHT_BANKS = 1             # one kernel's weights must fit one bank [§9: MTX check]

# --- Task / submit ----------------------------------------------------------------------
MAX_TASKS_PER_SUBMIT = 4095     # PC TASK_NUMBER 12 bits; VEND max_submit_number [§4, §9]
assert MAX_TASKS_PER_SUBMIT == _field_max("PC_TASK_CON", "TASK_NUMBER")
ADDRESS_BITS = 32               # all DMA address fields are 32-bit [§4 semantics, §9]
MAX_ADDRESS = (1 << ADDRESS_BITS) - 1
REGCMD_ALIGN = 16               # PC_BASE_ADDRESS field is bits 31:4 [§2]
REGCMD_TASK_ALIGN = 64          # MESA aligns every task's regcmd to 64 B [§2]; we follow it
DATA_ALIGN = 16                 # feature/output atoms are 16 B; DST_BASE_ADDR [31:4] use [§6, §7]
INT_MASK_DPU = 0x300            # DPU group0|group1 [§3]
INT_MASK_PPU = 0xC00            # [§3]
INT_CLEAR_ALL = 0x1FFFF         # every PC INTERRUPT_CLEAR bit: RKNPU_INT_CLEAR, rocket's IRQ clear, and what
                                # the RKNN runtime writes into rknpu_task.int_clear [§3; capture pw_c256_h14 task BO]
ADDRESS_WINDOW_BYTES = 1 << ADDRESS_BITS   # the NPU's whole IOVA space [§4]
# The version the kernel reports (PC VERSION + VERSION_NUM & 0xffff): a mainline boot log shows
# 1179210309 = 0x46495245 [§3; ollama issue #5001]. How it splits between the two is unknown.
HW_VERSION = 0x46495245
PAGE_BYTES = 4096               # IOMMU and GEM page: buffers are whole pages, IOVA 0 is never mapped [§4]

# --- Precisions -------------------------------------------------------------------------
# CNA and CORE *_PRECISION codes [TRM; §1]
CNA_PRECISION = {"int8": 0, "int16": 1, "fp16": 2, "bf16": 3, "int4": 6, "tf32": 7}
# DPU DATA_FORMAT and DPU_RDMA codes [TRM; §1; MTX npu_hw.h agrees for int8/fp16/int32/fp32]
DPU_PRECISION = {"int8": 0, "int16": 1, "fp16": 2, "bf16": 3, "int32": 4, "fp32": 5, "int4": 6}
BYTES = {"int8": 1, "int16": 2, "fp16": 2, "bf16": 2, "int32": 4, "fp32": 4}

# --- Layout atoms -----------------------------------------------------------------------
ATOM_BYTES = 16                 # feature/output atom: C2 = 16 / bytes per element [§1, §6]
KERNEL_GROUP = {"fp16": 16, "int8": 32}   # kernels per group [TRM CONV_CON2; MESA; MTX; §1]
K_ALIGN = 32                    # MAC channel atom: 32 input channels both precisions [§1, §6]
# N alignment = kernel group (SDK: N % 32 int8, N % 16 fp16) [§6]


def c2(dtype: str) -> int:
    """Channels per 16-byte atom for a feature/output precision [§6]."""
    return ATOM_BYTES // BYTES[dtype]


# --- Field-width limits (from the register database) [registers.xml; §9 table] -----------
MAX_DATAIN_HEIGHT = _field_max("CNA_DATA_SIZE0", "DATAIN_HEIGHT")            # 2047
MAX_DATAIN_WIDTH = _field_max("CNA_DATA_SIZE0", "DATAIN_WIDTH")              # 2047
MAX_DATAIN_CHANNEL = _field_max("CNA_DATA_SIZE1", "DATAIN_CHANNEL")          # 65535
MAX_WEIGHT_KERNELS = _field_max("CNA_WEIGHT_SIZE2", "WEIGHT_KERNELS")        # 16383
MAX_WEIGHT_BYTES_PER_KERNEL = _field_max("CNA_WEIGHT_SIZE1", "WEIGHT_BYTES_PER_KERNEL")
MAX_DATAOUT_ATOMICS = _field_max("CNA_DATA_SIZE3", "DATAOUT_ATOMICS")
MAX_FEATURE_GRAINS = _field_max("CNA_CONV_CON2", "FEATURE_GRAINS")           # 1023
MAX_DATA_ENTRIES = _field_max("CNA_CBUF_CON1", "DATA_ENTRIES")
MAX_DPU_CUBE = _field_max("DPU_DATA_CUBE_CHANNEL", "CHANNEL") + 1            # 8192 (field = n-1)
MAX_DPU_HEIGHT = _field_max("DPU_DATA_CUBE_HEIGHT", "HEIGHT") + 1            # 8192
MAX_CORE_DATAOUT = _field_max("CORE_DATAOUT_SIZE_1", "DATAOUT_CHANNEL") + 1  # 65536

# --- Software limits --------------------------------------------------------------------
SDK_MAX_K = 10240               # rknn_matmul_api K limit [SDK; §9; docs/rknn-toolkit.md set_io_mem]
# One kernel's weights must fit one bank: Kp * b <= 32 KiB [§9: MTX check] -> K <= 16384 fp16.
MAX_KERNEL_BYTES = CBUF_BANK_BYTES
