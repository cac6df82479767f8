"""The 64-bit register-command (regcmd) word, the 4-word task tail, PC fetch amounts.

A regcmd word is little-endian 64-bit: bits 63:48 target (which block(s) the write goes
to), 47:16 the 32-bit value, 15:0 the register offset including the block base
[docs/npu-programming.md §2; TRM pc_register_amounts; MESA rkt_regcmd.c; MTX NPUOP].
The shifts live here and nowhere else.
"""

from __future__ import annotations

from enum import IntEnum, IntFlag

from ggml_rknpu.hw.alignment import ceil_div
from ggml_rknpu.hw.registers import REGISTERS, Block, block_of_offset

TARGET_SHIFT = 48
VALUE_SHIFT = 16
OFFSET_MASK = 0xFFFF
VALUE_MASK = 0xFFFF_FFFF
TARGET_MASK = 0xFFFF

TAIL_WORDS = 4          # PC_BASE_ADDRESS, PC_REGISTER_AMOUNTS, marker, op-enable [§2]
FETCH_UNIT_WORDS = 2    # PC_DATA_AMOUNT counts 128-bit units = 2 words [§2]


class Target(IntEnum):
    """16-bit target values of observed words [docs/npu-programming.md §2 table; MESA, MTX, AB].

    Bit 48 is set in every observed word (meaning unknown); the block bits are
    56 PC, 57 CNA, 59 CORE, 60 DPU, 61 DPU_RDMA, 62 PPU, 63 PPU_RDMA [TRM].
    """

    PC = 0x0101
    CNA = 0x0201
    CORE = 0x0801
    DPU = 0x1001
    DPU_RDMA = 0x2001
    PPU = 0x4001
    PPU_RDMA = 0x8001
    MARKER = 0x0041      # "before op_en, 64'h0041_xxxx_xxxx_xxxx must be set" [TRM]
    OP_ENABLE = 0x0081   # bit 55 "set each block's op_en", register field 0x0008 [§2]


class OpEnable(IntFlag):
    """Op-enable block mask = bit layout of GLOBAL OPERATION_ENABLE 0xF008 [§2; registers.xml]."""

    CNA = 1
    CORE = 4
    DPU = 8
    DPU_RDMA = 16
    PPU = 32
    PPU_RDMA = 64


MATMUL_ENABLE = OpEnable.CNA | OpEnable.CORE | OpEnable.DPU   # 0x0D [§2: MTX; AB capture]

_TARGET_OF_BLOCK = {
    Block.PC: Target.PC,
    Block.CNA: Target.CNA,
    Block.CORE: Target.CORE,
    Block.DPU: Target.DPU,
    Block.DPU_RDMA: Target.DPU_RDMA,
    Block.PPU: Target.PPU,
    Block.PPU_RDMA: Target.PPU_RDMA,
}
BLOCK_OF_TARGET: dict[int, Block] = {t: b for b, t in _TARGET_OF_BLOCK.items()}   # looked up by a word's raw target

OP_ENABLE_OFFSET = REGISTERS["PC_OPERATION_ENABLE"].offset          # 0x0008 [§2]
_PC_BASE = REGISTERS["PC_BASE_ADDRESS"]
_PC_AMOUNTS = REGISTERS["PC_REGISTER_AMOUNTS"]


def regcmd_word(target: int, offset: int, value: int) -> int:
    """Encode one regcmd word; ValueError if a part does not fit its bits."""
    if not 0 <= target <= TARGET_MASK:
        raise ValueError(f"regcmd target 0x{target:X} is not 16-bit")
    if not 0 <= offset <= OFFSET_MASK:
        raise ValueError(f"regcmd register offset 0x{offset:X} is not 16-bit")
    if not 0 <= value <= VALUE_MASK:
        raise ValueError(f"regcmd value 0x{value:X} (offset 0x{offset:04X}) is not 32-bit")
    return (target << TARGET_SHIFT) | (value << VALUE_SHIFT) | offset


def decode_word(word: int) -> tuple[int, int, int]:
    """``(target, value, offset)`` of a regcmd word. The all-zero word is a NOP [§11]."""
    if not 0 <= word < 1 << 64:
        raise ValueError(f"regcmd word 0x{word:X} is not 64-bit")
    return (word >> TARGET_SHIFT) & TARGET_MASK, (word >> VALUE_SHIFT) & VALUE_MASK, word & OFFSET_MASK


def target_for_offset(offset: int) -> Target:
    """The block-write target for a register offset (bits 15:12 select the block [§1])."""
    block = block_of_offset(offset)
    try:
        return _TARGET_OF_BLOCK[block]
    except KeyError:
        raise ValueError(f"offset 0x{offset:04X} ({block.name}) has no regcmd write target") from None


def write_word(register_name: str, value: int) -> int:
    """Regcmd word writing ``value`` to the named register, targeted at its block."""
    reg = REGISTERS[register_name]
    return regcmd_word(target_for_offset(reg.offset), reg.offset, value)


def fetch_amount(body_words: int) -> int:
    """PC_DATA_AMOUNT for a task of ``body_words`` plus the 4-word tail:
    ``ceil((body + 4) / 2) - 1`` in 128-bit units [§2: VEND pc_data_amount_scale=2,
    ROCKET (regcmd_count+1)/2-1; matches the blob chain 108/13/12/17 -> 55/8/7/10]."""
    if body_words < 0:
        raise ValueError(f"body_words must be >= 0, got {body_words}")
    amount = ceil_div(body_words + TAIL_WORDS, FETCH_UNIT_WORDS) - 1
    _PC_AMOUNTS.field("PC_DATA_AMOUNT").insert(amount)   # 16-bit field [TRM]
    return amount


def words_for_amount(amount: int) -> int:
    """Number of 64-bit words the PC fetches for a PC_DATA_AMOUNT value [§11]."""
    if amount < 0:
        raise ValueError(f"amount must be >= 0, got {amount}")
    return (amount + 1) * FETCH_UNIT_WORDS


def marker_word() -> int:
    return regcmd_word(Target.MARKER, 0, 0)


def op_enable_word(enable_mask: int) -> int:
    return regcmd_word(Target.OP_ENABLE, OP_ENABLE_OFFSET, int(enable_mask))


def task_tail(next_regcmd_addr: int, next_body_words: int, enable_mask: int) -> list[int]:
    """The 4 tail words of a task [§2 canonical task layout; pcchain notes].

    Word 0: PC_BASE_ADDRESS = next task's regcmd DMA address (16-byte aligned, field
    [31:4]); an all-zero NOP word for the last task (``next_regcmd_addr == 0``), as MTX.
    Word 1: PC_REGISTER_AMOUNTS = fetch_amount(next body); 0 for the last task.
    Word 2: the 0x0041 marker. Word 3: op-enable with the block mask.
    """
    if next_regcmd_addr == 0:
        if next_body_words != 0:
            raise ValueError("last task (next address 0) must have next_body_words 0")
        base_word, amount = 0, 0
    else:
        if next_regcmd_addr % 16:
            raise ValueError(f"next regcmd address 0x{next_regcmd_addr:X} is not 16-byte aligned")
        base_value = _PC_BASE.encode(PC_SOURCE_ADDR=next_regcmd_addr >> 4, PC_SEL=0)
        base_word = regcmd_word(Target.PC, _PC_BASE.offset, base_value)
        amount = fetch_amount(next_body_words)
    amounts_word = regcmd_word(Target.PC, _PC_AMOUNTS.offset, _PC_AMOUNTS.encode(PC_DATA_AMOUNT=amount))
    return [base_word, amounts_word, marker_word(), op_enable_word(enable_mask)]
