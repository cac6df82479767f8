"""The RK3588 NPU register database: blocks, absolute offsets, named bit fields, a source for
every register; the compiler encodes and the simulator decodes with this one table.

The bulk is Mesa's ``registers.xml`` (MIT, machine-extracted from the TRM), converted by
``scripts/gen-hw-registers`` into ``_register_table.py``; registers real streams write but
no document describes are added below with their own source. Keys are ``<BLOCK>_<NAME>``;
the XML's redundant ``RDMA_`` prefix inside the DPU_RDMA / PPU_RDMA domains is dropped.
``Block`` also lists DDMA (0x8) and SDMA (0x9)
[docs/npu-programming.md §1]."""

from __future__ import annotations

from dataclasses import dataclass
from enum import IntEnum

from ggml_rknpu.hw._register_table import REGISTERS_XML_ROWS

XML_SOURCE = "registers.xml (Mesa rocket, MIT; extracted from RK3588 TRM ch.36)"


class Block(IntEnum):
    """Bits [15:12] of a register offset select the block [docs/npu-programming.md §1, TRM 36.4.1]."""

    PC = 0x0
    CNA = 0x1
    CORE = 0x3
    DPU = 0x4
    DPU_RDMA = 0x5
    PPU = 0x6
    PPU_RDMA = 0x7
    DDMA = 0x8
    SDMA = 0x9
    GLOBAL = 0xF


def block_of_offset(offset: int) -> Block:
    """The block an absolute register offset belongs to (ValueError if none)."""
    try:
        return Block((offset >> 12) & 0xF)
    except ValueError:
        raise ValueError(f"offset 0x{offset:04X} lies in no NPU block") from None


@dataclass(frozen=True)
class Field:
    """A bit range ``lo..hi`` (inclusive) of a 32-bit register."""

    name: str
    lo: int
    hi: int

    @property
    def width(self) -> int:
        return self.hi - self.lo + 1

    @property
    def max_value(self) -> int:
        return (1 << self.width) - 1

    @property
    def mask(self) -> int:
        return self.max_value << self.lo

    def fits(self, value: int) -> bool:
        return 0 <= value <= self.max_value

    def insert(self, value: int) -> int:
        """``value`` shifted into place; ValueError naming the field if it does not fit."""
        if not self.fits(value):
            raise ValueError(
                f"field {self.name}[{self.hi}:{self.lo}] is {self.width} bits; "
                f"value {value} (0x{value:X}) does not fit (0..{self.max_value})"
            )
        return value << self.lo

    def extract(self, register_value: int) -> int:
        return (register_value >> self.lo) & self.max_value


@dataclass(frozen=True)
class Register:
    name: str            # key, e.g. "CNA_CONV_CON1"
    block: Block
    offset: int          # absolute offset including the block base, e.g. 0x100C
    fields: tuple[Field, ...]
    source: str

    def field(self, name: str) -> Field:
        for f in self.fields:
            if f.name == name:
                return f
        raise KeyError(f"{self.name} has no field {name!r}; fields: {[f.name for f in self.fields]}")

    def encode(self, **fields: int) -> int:
        """32-bit value with the named fields set, all others 0."""
        value = 0
        for name, v in fields.items():
            value |= self.field(name).insert(int(v))
        return value

    def decode(self, value: int) -> dict[str, int]:
        if not 0 <= value <= 0xFFFFFFFF:
            raise ValueError(f"{self.name}: register value 0x{value:X} is not 32-bit")
        return {f.name: f.extract(value) for f in self.fields}


def _build() -> dict[str, Register]:
    regs: dict[str, Register] = {}
    for domain, name, offset, fields in REGISTERS_XML_ROWS:
        reg = Register(
            name=f"{domain}_{name}",
            block=Block[domain],
            offset=offset,
            fields=tuple(Field(n, lo, hi) for n, lo, hi in fields),
            source=XML_SOURCE,
        )
        regs[reg.name] = reg
    # Written (as 0) in every known matmul/conv stream, absent from the TRM and the XML.
    # Meaning unknown; the whole word is one opaque field.
    undocumented = (
        ("CORE_UNDOC_3030", Block.CORE, 0x3030,
         "undocumented; written as 0 by MESA, MTX and AB streams [docs/npu-programming.md §2]"),
        ("DPU_UNDOC_40C4", Block.DPU, 0x40C4,
         "undocumented; written as 0 by MESA and MTX streams [docs/npu-programming.md §2]"),
    )
    for name, block, offset, source in undocumented:
        regs[name] = Register(name, block, offset, (Field("VALUE", 0, 31),), source)
    return regs


REGISTERS: dict[str, Register] = _build()
BY_OFFSET: dict[int, Register] = {r.offset: r for r in REGISTERS.values()}
assert len(BY_OFFSET) == len(REGISTERS), "two registers share an offset"


def register_at(offset: int) -> Register:
    """The register at an absolute offset; KeyError with a readable message if unknown."""
    try:
        return BY_OFFSET[offset]
    except KeyError:
        raise KeyError(f"no known register at offset 0x{offset:04X}") from None
