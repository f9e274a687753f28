"""A GGUF tensor's quantised blocks read as integer codes and per-group scales, the file's own values.

Every block format read here stores each group of 16 or 32 weights as `scale * code + offset`:
an integer code of at most 8 bits, and a scale and offset computed once per group from the
block's half-precision factors (products that are exact in float32). Kept that way, a weight costs
1 byte and its group's factors 4 or 8 bytes per 16 or 32 weights, and expanding a group again,
`scale * code + offset` in float32, gives bit for bit the value the file dequantises to (gguf's
own reference dequantiser rounds once, at the same addition). Formats with other structure (the
2- and 3-bit K formats, the i-quants) are not read here: `None`, and the caller holds that tensor
dense.

Example:
    blocks = decode(raw_bytes, "Q4_K", rows=8960, cols=1536)
    blocks.codes.shape, blocks.scale.shape, blocks.group     # (8960, 1536), (8960, 48), 32
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np

SUPER = 256  # weights in a K-format super-block


@dataclass(frozen=True)
class Blocks:
    """A 2-D weight as codes and per-group factors: weight[r, g*group + i] =
    scale[r, g] * codes[r, g*group + i] + offset[r, g] (offset None: zero).

    Attributes:
        codes: int8, (rows, cols).
        scale: float32, (rows, cols // group).
        offset: float32 like `scale`, or None.
        group: how many consecutive weights of a row share one scale.
        kind: the file's format name ("Q4_K").
        packed: a 4-bit format's codes two a byte, as the file holds them (`pack`'s layout,
            (rows, cols // 2) uint8).
    """

    codes: np.ndarray
    scale: np.ndarray
    offset: np.ndarray | None
    group: int
    kind: str
    packed: bool = False

    def expand(self) -> np.ndarray:
        """The float32 weights (the slow, obviously correct reference)."""
        codes = unpack(self.codes, FOUR_BITS[self.kind], SPAN[self.kind]) if self.packed else self.codes
        rows, cols = codes.shape
        grouped = codes.reshape(rows, cols // self.group, self.group).astype(np.float32)
        out = grouped * self.scale[..., None]
        if self.offset is not None:
            out = out + self.offset[..., None]
        return out.reshape(rows, cols)


def _f16(column: np.ndarray) -> np.ndarray:
    """Two bytes a block read as one float16, widened to float32 (exactly)."""
    return np.ascontiguousarray(column).view(np.float16).astype(np.float32).reshape(-1)


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


def _q4_0(b: np.ndarray, unpack: bool = True) -> tuple:
    codes = _nibbles(b[:, 2:], 1).astype(np.int8) - 8 if unpack else None
    return codes, _f16(b[:, :2])[:, None], None


def _q4_1(b: np.ndarray, unpack: bool = True) -> tuple:
    codes = _nibbles(b[:, 4:], 1).astype(np.int8) if unpack else None
    return codes, _f16(b[:, :2])[:, None], _f16(b[:, 2:4])[:, None]


def _q5_0(b: np.ndarray) -> tuple:
    q = _nibbles(b[:, 6:], 1) | (_high_bits(b[:, 2:6], 32) << 4)
    return q.astype(np.int8) - 16, _f16(b[:, :2])[:, None], None


def _q5_1(b: np.ndarray) -> tuple:
    q = _nibbles(b[:, 8:], 1) | (_high_bits(b[:, 4:8], 32) << 4)
    return q.astype(np.int8), _f16(b[:, :2])[:, None], _f16(b[:, 2:4])[:, None]


def _q8_0(b: np.ndarray) -> tuple:
    return np.ascontiguousarray(b[:, 2:]).view(np.int8), _f16(b[:, :2])[:, None], None


def _k_scales(packed: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The 6-bit scale and minimum of each of a K super-block's 8 groups (12 bytes a block)."""
    low, mid, top = packed[:, 0:4], packed[:, 4:8], packed[:, 8:12]
    scales = np.concatenate([low & 0x3F, (top & 0x0F) | ((low >> 2) & 0x30)], axis=1)
    mins = np.concatenate([mid & 0x3F, (top >> 4) | ((mid >> 2) & 0x30)], axis=1)
    return scales.astype(np.float32), mins.astype(np.float32)


def _q4_k(b: np.ndarray, unpack: bool = True) -> tuple:
    scales, mins = _k_scales(b[:, 4:16])
    codes = _nibbles(b[:, 16:], 4).astype(np.int8) if unpack else None
    return codes, _f16(b[:, :2])[:, None] * scales, -(_f16(b[:, 2:4])[:, None] * mins)


def _q5_k(b: np.ndarray) -> tuple:
    scales, mins = _k_scales(b[:, 4:16])
    high = b[:, 16:48].reshape(-1, 1, 32) >> np.arange(8, dtype=np.uint8).reshape(1, 8, 1)
    q = _nibbles(b[:, 48:], 4) | ((high & 1).reshape(len(b), -1) << 4)
    return q.astype(np.int8), _f16(b[:, :2])[:, None] * scales, -(_f16(b[:, 2:4])[:, None] * mins)


def _q6_k(b: np.ndarray) -> tuple:
    low = _nibbles(b[:, :128], 2)
    high = b[:, 128:192].reshape(-1, 2, 1, 32) >> np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 1, 4, 1)
    q = low | ((high & 3).reshape(len(b), -1) << 4)
    scales = np.ascontiguousarray(b[:, 192:208]).view(np.int8).astype(np.float32)
    return q.astype(np.int8) - 32, _f16(b[:, 208:210])[:, None] * scales, None


# format name -> (weights a block, bytes a block, weights a group shares factors over, decoder of
# (blocks, bytes) into codes and factors)
FORMATS: dict[str, tuple[int, int, int, Callable[..., tuple]]] = {
    "Q4_0": (32, 18, 32, _q4_0), "Q4_1": (32, 20, 32, _q4_1), "Q5_0": (32, 22, 32, _q5_0),
    "Q5_1": (32, 24, 32, _q5_1), "Q8_0": (32, 34, 32, _q8_0), "Q4_K": (SUPER, 144, 32, _q4_k),
    "Q5_K": (SUPER, 176, 32, _q5_k), "Q6_K": (SUPER, 210, 16, _q6_k),
}


WITH_OFFSET = frozenset({"Q4_1", "Q5_1", "Q4_K", "Q5_K"})  # the formats whose groups have an offset
FOUR_BITS = {"Q4_0": -8, "Q4_1": 0, "Q4_K": 0}  # formats whose codes are 16 values from this one: two a byte
# how the file packs them: runs of SPAN bytes, each holding SPAN weights in its low nibbles, then the
# next SPAN in its high ones; (start of the packed bytes in a block)
SPAN = {"Q4_0": 16, "Q4_1": 16, "Q4_K": 32}
PACKED_AT = {"Q4_0": 2, "Q4_1": 4, "Q4_K": 16}


def kept_size(kind: str, rows: int, cols: int) -> int | None:
    """Bytes a (rows, cols) tensor of `kind` takes kept as codes and factors; None where it is not."""
    if kind not in FORMATS or cols % FORMATS[kind][0]:
        return None
    group = FORMATS[kind][2]
    codes = rows * cols // 2 if kind in FOUR_BITS else rows * cols
    return codes + rows * (cols // group) * 4 * (2 if kind in WITH_OFFSET else 1)


def pack(codes: np.ndarray, low: int, span: int) -> np.ndarray:
    """Codes of 16 values from `low`, two a byte as the file packs them: in each run of 2 * span
    weights, the first span in the low nibbles, the next in the high ones; (rows, cols) ->
    (rows, cols // 2) uint8."""
    rows, cols = codes.shape
    halves = (codes.astype(np.int16) - low).astype(np.uint8).reshape(rows, cols // (2 * span), 2, span)
    return (halves[:, :, 0, :] | (halves[:, :, 1, :] << 4)).reshape(rows, cols // 2)


def raw_size(kind: str, rows: int, cols: int) -> int:
    """Bytes a (rows, cols) tensor of `kind` takes in the file."""
    per_block, size, _, _ = FORMATS[kind]
    return rows * (cols // per_block) * size


def unpack(packed: np.ndarray, low: int, span: int) -> np.ndarray:
    """`pack` undone: (rows, cols // 2) uint8 -> (rows, cols) int8 codes."""
    rows, half = packed.shape
    runs = packed.reshape(rows, half // span, 1, span)
    nibbles = (runs >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)) & 0x0F
    return (nibbles.astype(np.int16) + low).astype(np.int8).reshape(rows, half * 2)


def decode(raw: bytes | bytearray | memoryview | np.ndarray, kind: str, rows: int, cols: int, packed: bool = False
           ) -> Blocks | None:
    """The tensor's codes and factors; None for a format not read here or a row that is not whole
    blocks. `packed`: a 4-bit format's codes left two a byte as the file holds them (`pack`'s
    layout, (rows, cols // 2) uint8). Raises ValueError where `raw` is not the tensor's size."""
    if kind not in FORMATS:
        return None
    per_block, size, group, decoder = FORMATS[kind]
    if cols % per_block:
        return None
    data = np.frombuffer(raw, dtype=np.uint8) if not isinstance(raw, np.ndarray) else raw.view(np.uint8).reshape(-1)
    if data.size != raw_size(kind, rows, cols):
        raise ValueError(f"a {kind} tensor of {rows}x{cols} takes {raw_size(kind, rows, cols)} bytes, not {data.size}")
    blocks = data.reshape(-1, size)
    if packed and kind in FOUR_BITS:
        _, scale, offset = decoder(blocks, False)
        codes = blocks[:, PACKED_AT[kind]:].reshape(rows, cols // 2)
    else:
        codes, scale, offset = decoder(blocks)
    groups = cols // group
    return Blocks(np.ascontiguousarray(codes.reshape(rows, -1)),
                  np.ascontiguousarray(scale.reshape(rows, groups), dtype=np.float32),
                  None if offset is None else np.ascontiguousarray(offset.reshape(rows, groups), dtype=np.float32),
                  group, kind, packed and kind in FOUR_BITS)
