"""A GGUF tensor's quantised blocks read as integer codes and per-group scales, the file's own values.

Every block format read here stores each group of 16 or 32 weights as `scale * code + offset`:
an integer code of at most 8 bits, and a scale and offset per group, each a half-precision number
or (the K formats) a 6- or 8-bit integer times its super-block's half-precision factor: products
that are exact in float32. Kept as the file keeps them, a weight costs what the file spends on it
(codes under 8 bits two a byte, the top bits of 5- and 6-bit codes in bit planes; the factors in
their own widths), and expanding a group again, `scale * code + offset` in float32, gives bit for
bit the value the file dequantises to (gguf's own reference dequantiser rounds once, at the same
addition). Formats with other structure (the 2- and 3-bit K formats, the i-quants) are not read
here: `None`, and the caller holds that tensor dense.

Example:
    blocks = decode(raw_bytes, "Q4_K", rows=8960, cols=1536, packed=True)
    blocks.codes.shape, blocks.scale.full().shape, blocks.group     # (8960, 768), (8960, 48), 32"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np

SUPER = 256  # weights in a K-format super-block


@dataclass(frozen=True)
class Factor:
    """A group factor (a scale or an offset) as the file holds it: `values` (rows, groups), float16
    where the file's factor is one half-precision number; else small integers times `unit`
    (rows, groups // per), the float32 factor its super-block shares (a K format's 6- or 8-bit
    group scales times its half-precision `d`): the product, exact in float32, is the factor."""

    values: np.ndarray
    unit: np.ndarray | None = None

    def full(self) -> np.ndarray:
        """The float32 factors, (rows, groups)."""
        values = self.values.astype(np.float32)
        if self.unit is None:
            return values
        rows, groups = values.shape
        per = groups // self.unit.shape[1]
        return (values.reshape(rows, -1, per) * self.unit[..., None]).reshape(rows, groups)


@dataclass(frozen=True)
class Blocks:
    """A 2-D weight as codes and per-group factors: weight[r, g*group + i] =
    scale[r, g] * codes[r, g*group + i] + offset[r, g] (offset None: zero).

    Attributes:
        codes: int8, (rows, cols); or, `packed`, a code less LOW (16 values, or its low 4 bits
            where it has 5 or 6) two a byte in `pack`'s layout, (rows, cols // 2) uint8.
        scale: the factor each group's codes are multiplied by.
        offset: a Factor like `scale`, or None.
        group: how many consecutive weights of a row share one scale.
        kind: the file's format name ("Q4_K").
        packed: codes kept as small as the file keeps them.
        high: with `packed` and codes of 5 or 6 bits, their top `bits - 4` bits (`planes`'
            layout, (rows, cols * (bits - 4) // 8) uint8); else None.
    """

    codes: np.ndarray
    scale: Factor
    offset: Factor | None
    group: int
    kind: str
    packed: bool = False
    high: np.ndarray | None = None

    def arrays(self) -> dict[str, np.ndarray | None]:
        """Every array held, by name, each (rows, ...): codes, high, scale, scale_unit, offset,
        offset_unit (None where not held)."""
        out: dict[str, np.ndarray | None] = {"codes": self.codes, "high": self.high}
        for name, factor in (("scale", self.scale), ("offset", self.offset)):
            out[name] = None if factor is None else factor.values
            out[name + "_unit"] = None if factor is None else factor.unit
        return out

    def expand(self) -> np.ndarray:
        """The float32 weights (the slow, obviously correct reference)."""
        codes = self.codes
        if self.packed:
            bits = BITS[self.kind]
            u = unpack(codes).astype(np.int16)
            if self.high is not None:
                u = u | (unplane(self.high, bits - 4).astype(np.int16) << 4)
            codes = (u + LOW[self.kind]).astype(np.int8)
        rows, cols = codes.shape
        grouped = codes.reshape(rows, cols // self.group, self.group).astype(np.float32)
        out = grouped * self.scale.full()[..., None]
        if self.offset is not None:
            out = out + self.offset.full()[..., None]
        return out.reshape(rows, cols)


def _f16(column: np.ndarray) -> np.ndarray:
    """Two bytes a block read as one float16, (blocks, 1)."""
    return np.ascontiguousarray(column).view(np.float16).reshape(-1, 1)


def _nibbles(packed: np.ndarray, halves: int) -> np.ndarray:
    """Bytes (blocks, n) split into 4-bit codes: each run of `n // halves` bytes gives its low
    nibbles, then its high ones (the order ggml packs them in)."""
    n_blocks, n = packed.shape
    runs = packed.reshape(n_blocks, halves, 1, n // halves)
    return ((runs >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)) & 0x0F).reshape(n_blocks, -1)


def _high_bits(packed: np.ndarray, count: int) -> np.ndarray:
    """Four bytes a block as 32 one-bit values, bit i for weight i."""
    bits = np.ascontiguousarray(packed).view(np.uint32).reshape(-1, 1)
    return ((bits >> np.arange(count, dtype=np.uint32).reshape(1, count)) & 1).astype(np.uint8)


# Each decoder: (blocks, bytes) -> the codes less LOW (unsigned), the scale and the offset as
# (values, unit or None) per block, or None.
def _q4_0(b: np.ndarray) -> tuple:
    return _nibbles(b[:, 2:], 1), (_f16(b[:, :2]), None), None


def _q4_1(b: np.ndarray) -> tuple:
    return _nibbles(b[:, 4:], 1), (_f16(b[:, :2]), None), (_f16(b[:, 2:4]), None)


def _q5_0(b: np.ndarray) -> tuple:
    return _nibbles(b[:, 6:], 1) | (_high_bits(b[:, 2:6], 32) << 4), (_f16(b[:, :2]), None), None


def _q5_1(b: np.ndarray) -> tuple:
    u = _nibbles(b[:, 8:], 1) | (_high_bits(b[:, 4:8], 32) << 4)
    return u, (_f16(b[:, :2]), None), (_f16(b[:, 2:4]), None)


def _q8_0(b: np.ndarray) -> tuple:
    return np.ascontiguousarray(b[:, 2:]).view(np.int8), (_f16(b[:, :2]), None), None


def _k_scales(packed: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The 6-bit scale and minimum of each of a K super-block's 8 groups (12 bytes a block)."""
    low, mid, top = packed[:, 0:4], packed[:, 4:8], packed[:, 8:12]
    scales = np.concatenate([low & 0x3F, (top & 0x0F) | ((low >> 2) & 0x30)], axis=1)
    mins = np.concatenate([mid & 0x3F, (top >> 4) | ((mid >> 2) & 0x30)], axis=1)
    return scales, mins


def _k_factors(b: np.ndarray) -> tuple:
    """A Q4_K or Q5_K block's scale (6-bit scales times d) and offset (6-bit minimums times -dmin)."""
    scales, mins = _k_scales(b[:, 4:16])
    return (scales, _f16(b[:, :2]).astype(np.float32)), (mins, -_f16(b[:, 2:4]).astype(np.float32))


def _q4_k(b: np.ndarray) -> tuple:
    return _nibbles(b[:, 16:], 4), *_k_factors(b)


def _q5_k(b: np.ndarray) -> tuple:
    high = b[:, 16:48].reshape(-1, 1, 32) >> np.arange(8, dtype=np.uint8).reshape(1, 8, 1)
    return _nibbles(b[:, 48:], 4) | ((high & 1).reshape(len(b), -1) << 4), *_k_factors(b)


def _q6_k(b: np.ndarray) -> tuple:
    low = _nibbles(b[:, :128], 2)
    high = b[:, 128:192].reshape(-1, 2, 1, 32) >> np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 1, 4, 1)
    scales = np.ascontiguousarray(b[:, 192:208]).view(np.int8)
    return low | ((high & 3).reshape(len(b), -1) << 4), (scales, _f16(b[:, 208:210]).astype(np.float32)), None


# format name -> (weights a block, bytes a block, weights a group shares factors over, decoder)
FORMATS: dict[str, tuple[int, int, int, Callable[..., tuple]]] = {
    "Q4_0": (32, 18, 32, _q4_0), "Q4_1": (32, 20, 32, _q4_1), "Q5_0": (32, 22, 32, _q5_0),
    "Q5_1": (32, 24, 32, _q5_1), "Q8_0": (32, 34, 32, _q8_0), "Q4_K": (SUPER, 144, 32, _q4_k),
    "Q5_K": (SUPER, 176, 32, _q5_k), "Q6_K": (SUPER, 210, 16, _q6_k),
}
BITS = {"Q4_0": 4, "Q4_1": 4, "Q5_0": 5, "Q5_1": 5, "Q8_0": 8, "Q4_K": 4, "Q5_K": 5, "Q6_K": 6}  # a code's
LOW = {"Q4_0": -8, "Q4_1": 0, "Q5_0": -16, "Q5_1": 0, "Q4_K": 0, "Q5_K": 0, "Q6_K": -32}  # a code, less this, is unsigned


WITH_OFFSET = frozenset({"Q4_1", "Q5_1", "Q4_K", "Q5_K"})  # the formats whose groups have an offset


def kept_size(kind: str, rows: int, cols: int) -> int | None:
    """Bytes a (rows, cols) tensor of `kind` takes kept as codes and factors; None where it is not."""
    if kind not in FORMATS or cols % FORMATS[kind][0]:
        return None
    per_block, _, group, _ = FORMATS[kind]
    bits = BITS[kind]
    codes = rows * cols if bits == 8 else rows * cols // 2 + rows * cols * (bits - 4) // 8
    groups = rows * (cols // group)
    factor = groups + rows * (cols // SUPER) * 4 if per_block == SUPER else groups * 2
    return codes + factor * (2 if kind in WITH_OFFSET else 1)


def pack(nibbles: np.ndarray) -> np.ndarray:
    """4-bit values (uint8 under 16), two a byte: a row's first half in the low nibbles, its second
    half in the high ones (each half then unpacks in one pass over contiguous bytes);
    (rows, cols) -> (rows, cols // 2) uint8."""
    rows, cols = nibbles.shape
    halves = nibbles.reshape(rows, 2, cols // 2)
    return halves[:, 0, :] | (halves[:, 1, :] << 4)


def unpack(packed: np.ndarray) -> np.ndarray:
    """`pack` undone: (rows, cols // 2) uint8 -> (rows, cols) uint8."""
    return np.concatenate([packed & 0x0F, packed >> 4], axis=1)


def planes(values: np.ndarray, bits: int) -> np.ndarray:
    """Values of `bits` bits (1 or 2), 8 // bits a byte: of a row's cols values, byte j holds
    value k * (cols * bits // 8) + j at bit k * bits; (rows, cols) -> (rows, cols * bits // 8) uint8."""
    rows, cols = values.shape
    each = 8 // bits
    parts = values.astype(np.uint8).reshape(rows, each, cols // each)
    shifts = (np.arange(each, dtype=np.uint8) * bits).reshape(1, each, 1)
    return np.bitwise_or.reduce(parts << shifts, axis=1).astype(np.uint8)


def unplane(packed: np.ndarray, bits: int) -> np.ndarray:
    """`planes` undone: (rows, cols * bits // 8) uint8 -> (rows, cols) uint8."""
    rows, width = packed.shape
    each = 8 // bits
    shifts = (np.arange(each, dtype=np.uint8) * bits).reshape(1, each, 1)
    return ((packed[:, None, :] >> shifts) & ((1 << bits) - 1)).reshape(rows, width * each)


def raw_size(kind: str, rows: int, cols: int) -> int:
    """Bytes a (rows, cols) tensor of `kind` takes in the file."""
    per_block, size, _, _ = FORMATS[kind]
    return rows * (cols // per_block) * size


def _factor(pair: tuple | None, rows: int, groups: int) -> Factor | None:
    if pair is None:
        return None
    values, unit = pair
    return Factor(np.ascontiguousarray(values.reshape(rows, groups)),
                  None if unit is None else np.ascontiguousarray(unit.reshape(rows, -1), dtype=np.float32))


def decode(raw: bytes | bytearray | memoryview | np.ndarray, kind: str, rows: int, cols: int, packed: bool = False
           ) -> Blocks | None:
    """The tensor's codes and factors; None for a format not read here or a row that is not whole
    blocks. `packed`: codes under 8 bits kept two a byte, their top bits in planes (`Blocks`),
    as small as the file keeps them. Raises ValueError where `raw` is not the tensor's size."""
    if kind not in FORMATS:
        return None
    per_block, size, group, decoder = FORMATS[kind]
    if cols % per_block:
        return None
    data = np.frombuffer(raw, dtype=np.uint8) if not isinstance(raw, np.ndarray) else raw.view(np.uint8).reshape(-1)
    if data.size != raw_size(kind, rows, cols):
        raise ValueError(f"a {kind} tensor of {rows}x{cols} takes {raw_size(kind, rows, cols)} bytes, not {data.size}")
    blocks = data.reshape(-1, size)
    u, scale, offset = decoder(blocks)
    high = None
    if kind not in LOW:  # 8-bit codes, kept as they are
        codes = np.ascontiguousarray(u.reshape(rows, cols))
    elif packed:
        codes, high = _packed(u.reshape(rows, cols), kind)
    else:
        codes = (u.reshape(rows, cols).astype(np.int16) + LOW[kind]).astype(np.int8)
    groups = cols // group
    kept_scale = _factor(scale, rows, groups)
    assert kept_scale is not None  # every format has a scale
    return Blocks(codes, kept_scale, _factor(offset, rows, groups), group, kind, packed and kind in LOW, high)


def _packed(u: np.ndarray, kind: str) -> tuple[np.ndarray, np.ndarray | None]:
    """Unsigned codes (uint8, rows x cols) of a format under 8 bits as they are kept: their low
    4 bits two a byte (`pack`) and, for 5 and 6 bits, their top bits in planes (`planes`)."""
    extra = BITS[kind] - 4
    return (pack(u & 0x0F), planes(u >> 4, extra)) if extra else (pack(u), None)


def compact(blocks: Blocks) -> Blocks:
    """`blocks` with its codes packed (`decode`'s `packed`), if they are not."""
    if blocks.packed or blocks.kind not in LOW:
        return blocks
    codes, high = _packed((blocks.codes.astype(np.int16) - LOW[blocks.kind]).astype(np.uint8), blocks.kind)
    return Blocks(codes, blocks.scale, blocks.offset, blocks.group, blocks.kind, True, high)
