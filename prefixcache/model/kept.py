"""Linear and embedding layers that keep a GGUF file's quantised weights and expand them as they run.

A GGUF model converted to float weights holds 4 bytes a weight in float32 and 2 in bfloat16; the
file holds 4.5-8.5 bits. Here a layer keeps the file's own integer codes (1 byte a weight) and its
groups' scales and offsets (model/ggufblocks.py), and each forward expands the weights into the
precision it computes in, a slice at a time through one float32 buffer that stays in the CPU's
cache, into a scratch tensor shared by all layers of that shape: the same values, bit for bit,
as the converted model in that precision holds (`scale * code + offset` in float32, then rounded
to the precision as `Tensor.to` rounds), so a record is the same whichever way the model loaded.
An output head too large for one scratch tensor (a 151,936-token vocabulary) is computed a slice
of its rows at a time. An embedding expands only the rows its tokens look up.

What it costs: the expansion, about 0.2-0.35 ns a weight on 2 cores, once a forward: small beside
the matrix products of a batch of hundreds of tokens, most of the cost of a forward of one token.

Example:
    layer = KeptLinear(codes, scale, offset, group=32, bias=None)
    layer(x)    # x in bfloat16: the bfloat16 weights the converted model would hold
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from .ggufblocks import Blocks

CHUNK = 1 << 20  # weights expanded through float32 at a time (4 MB: stays in the cache)
SCRATCH_MAX = 32 << 20  # bytes of one expanded weight; a larger one (an output head) runs a slice of rows at a time

_scratch = threading.local()  # (device, dtype, inference mode, slot) -> a flat tensor, per thread: layers run one after another
FACTORS = ("scale", "scale_unit", "offset", "offset_unit")


def _buffer(device: torch.device, dtype: torch.dtype, numel: int, slot: int = 0) -> torch.Tensor:
    """A flat scratch tensor of at least `numel` elements for this thread, reused by every layer
    (`slot`: another one of the same dtype, held at the same time)."""
    held = getattr(_scratch, "held", None)
    if held is None:
        held = _scratch.held = {}
    key = (device, dtype, torch.is_inference_mode_enabled(), slot)  # a tensor made in inference mode stays one
    found = held.get(key)
    if found is None or found.numel() < numel:
        found = held[key] = torch.empty(numel, device=device, dtype=dtype)
    return found[:numel]


def _factor(values: torch.Tensor, unit: torch.Tensor | None) -> torch.Tensor:
    """Rows of a group factor in float32: `values` as they are, or times their super-block's `unit`."""
    if unit is None:
        return values if values.dtype == torch.float32 else values.float()
    n = values.shape[0]
    return values.float().view(n, unit.shape[1], -1).mul_(unit.unsqueeze(-1)).view(n, -1)  # exact in float32


class KeptWeights(torch.nn.Module):
    """A 2-D weight as codes and per-group factors (buffers: they move with the model), expanded
    into any floating dtype on demand. The buffers are ggufblocks.Blocks' arrays: `codes` (8-bit
    codes, or codes less `low` two a byte, as ggufblocks.pack lays them out), `high` (the top bits
    of 5- and 6-bit codes, in planes), `scale` and `offset` (float16, or small integers times `scale_unit` and
    `offset_unit`)."""

    codes: torch.Tensor
    high: torch.Tensor | None
    scale: torch.Tensor
    scale_unit: torch.Tensor | None
    offset: torch.Tensor | None
    offset_unit: torch.Tensor | None

    def __init__(self, arrays: dict[str, torch.Tensor | None], group: int, kind: str) -> None:
        from .ggufblocks import BITS, LOW

        super().__init__()
        codes = arrays["codes"]
        assert codes is not None
        self.group, self.kind = group, kind
        self.low = LOW.get(kind) if codes.dtype == torch.uint8 else None  # None: int8 codes as they are
        self.bits = BITS[kind]
        self.rows, self.cols = codes.shape[0], codes.shape[1] * (1 if self.low is None else 2)
        for name in ("codes", "high", *FACTORS):
            self.register_buffer(name, arrays.get(name), persistent=False)

    @classmethod
    def of(cls, blocks: "Blocks") -> "KeptWeights":
        from .ggufblocks import compact

        return cls({k: None if v is None else torch.from_numpy(v) for k, v in compact(blocks).arrays().items()},
                   blocks.group, blocks.kind)

    def _grouped(self, codes: torch.Tensor, high: torch.Tensor | None) -> torch.Tensor:
        """Rows of `codes` (and their `high` bits) as integer codes (n, groups, group), unpacked
        into a scratch tensor where they are kept two a byte."""
        n, groups = codes.shape[0], self.cols // self.group
        if self.low is None:
            return codes.view(n, groups, self.group)
        out = _buffer(codes.device, torch.uint8, n * self.cols).view(n, 2, self.cols // 2)
        torch.bitwise_and(codes, 0x0F, out=out[:, 0])  # a row's first half
        torch.bitwise_right_shift(codes, 4, out=out[:, 1])  # its second
        flat = out.view(n, self.cols)
        if high is not None:  # 5- or 6-bit codes: their top bits, `planes`' layout
            extra = self.bits - 4
            each = 8 // extra
            top = _buffer(codes.device, torch.uint8, n * self.cols, slot=1).view(n, each, self.cols // each)
            shifts = torch.arange(0, 8, extra, dtype=torch.uint8, device=codes.device).view(1, each, 1)
            torch.bitwise_right_shift(high.unsqueeze(1), shifts, out=top)
            top.bitwise_and_((1 << extra) - 1).bitwise_left_shift_(4)
            flat.bitwise_or_(top.view(n, self.cols))
        if self.low:
            flat.sub_(-self.low if self.low < 0 else 256 - self.low)  # wraps: read as int8, code + low
            return flat.view(torch.int8).view(n, groups, self.group)
        return flat.view(n, groups, self.group)

    def _rows(self, rows: slice | torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """Rows (a slice or an index) as integer codes (n, groups, group) and float32 factors."""
        codes = self._grouped(self.codes[rows], None if self.high is None else self.high[rows])
        scale = _factor(self.scale[rows], None if self.scale_unit is None else self.scale_unit[rows])
        offset = None if self.offset is None else \
            _factor(self.offset[rows], None if self.offset_unit is None else self.offset_unit[rows])
        return codes, scale, offset

    @property
    def stored_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.buffers(recurse=False))

    def expand(self, start: int, stop: int, dtype: torch.dtype, into: torch.Tensor | None = None) -> torch.Tensor:
        """Rows [start, stop) in `dtype`, in this thread's scratch tensor (valid until the next
        call), or in `into` (a tensor of that shape and dtype) where given."""
        rows, cols, groups = stop - start, self.cols, self.cols // self.group
        out = into if into is not None else _buffer(self.codes.device, dtype, rows * cols).view(rows, cols)
        step = max(1, CHUNK // cols)
        wide = dtype == torch.float32
        for at in range(start, stop, step):
            end = min(stop, at + step)
            n = end - at
            final = out[at - start:end - start].view(n, groups, self.group)
            target = final if wide else _buffer(self.codes.device, torch.float32, n * cols).view(n, groups, self.group)
            codes, scale, offset = self._rows(slice(at, end))
            target.copy_(codes)  # exact; then one op a dtype (a mixed int-by-float product runs 4x slower)
            target.mul_(scale.unsqueeze(-1))
            if offset is not None:
                target.add_(offset.unsqueeze(-1))
            if not wide:
                final.copy_(target)
        return out

    def lookup(self, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """The rows `ids` names, in `dtype` (an embedding's look-up)."""
        codes, scale, offset = self._rows(ids.reshape(-1))
        values = codes * scale.unsqueeze(-1)
        if offset is not None:
            values = values + offset.unsqueeze(-1)
        return values.view(*ids.shape, self.cols).to(dtype)


class KeptLinear(torch.nn.Module):
    """`torch.nn.Linear` over kept weights: `x @ W.T + b`, W expanded into x's dtype each forward."""

    def __init__(self, weights: KeptWeights, bias: torch.nn.Parameter | None = None) -> None:
        super().__init__()
        self.kept = weights
        self.in_features, self.out_features = weights.cols, weights.rows
        self.bias = bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x.contiguous()  # a strided batch (the last positions sliced off) copies the weight once a row in matmul
        rows = self.out_features
        most = max(1, SCRATCH_MAX // (self.in_features * x.element_size()))
        if most >= rows:
            return torch.nn.functional.linear(x, self.kept.expand(0, rows, x.dtype), self.bias)
        slices = -(-rows // most)
        step = -(-rows // slices)  # slices of one size: no small remainder runs another kernel
        out = x.new_empty(*x.shape[:-1], rows)
        for at in range(0, rows, step):
            end = min(rows, at + step)
            bias = None if self.bias is None else self.bias[at:end]
            out[..., at:end] = torch.nn.functional.linear(x, self.kept.expand(at, end, x.dtype), bias)
        return out

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, kept groups of {self.kept.group}"


class KeptEmbedding(torch.nn.Module):
    """`torch.nn.Embedding` over kept weights: the looked-up rows expanded into `dtype`."""

    def __init__(self, weights: KeptWeights, dtype: torch.dtype) -> None:
        super().__init__()
        self.kept = weights
        self.num_embeddings, self.embedding_dim = weights.rows, weights.cols
        self.dtype = dtype

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.kept.lookup(ids, self.dtype)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, kept groups of {self.kept.group}"


def kept_modules(model: torch.nn.Module) -> list[KeptWeights]:
    """The kept weights of a model, each once (a tied head shares its embedding's)."""
    seen: dict[int, KeptWeights] = {}
    for module in model.modules():
        if isinstance(module, KeptWeights):
            seen.setdefault(id(module.codes), module)
    return list(seen.values())


def kept_bytes(model: torch.nn.Module) -> int:
    """Bytes the model's kept weights take."""
    return sum(k.stored_bytes for k in kept_modules(model))
