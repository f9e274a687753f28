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

_scratch = threading.local()  # (device, dtype) -> a flat tensor, per thread: layers run one after another


def _buffer(device: torch.device, dtype: torch.dtype, numel: int) -> torch.Tensor:
    """A flat scratch tensor of at least `numel` elements for this thread, reused by every layer."""
    held = getattr(_scratch, "held", None)
    if held is None:
        held = _scratch.held = {}
    key = (device, dtype, torch.is_inference_mode_enabled())  # a tensor made in inference mode stays one
    found = held.get(key)
    if found is None or found.numel() < numel:
        found = held[key] = torch.empty(numel, device=device, dtype=dtype)
    return found[:numel]


class KeptWeights(torch.nn.Module):
    """A 2-D weight as codes and per-group factors (buffers: they move with the model), expanded
    into any floating dtype on demand."""

    codes: torch.Tensor
    scale: torch.Tensor
    offset: torch.Tensor | None

    def __init__(self, codes: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor | None, group: int,
                 low: int | None = None, span: int = 0) -> None:
        """`codes`: int8 (rows, cols); or, with `low`, 4-bit codes less `low` two a byte (uint8,
        (rows, cols // 2), in runs of `span` bytes as ggufblocks.pack lays them out)."""
        super().__init__()
        self.group, self.low, self.span = group, low, span
        self.rows, self.cols = codes.shape[0], codes.shape[1] * (1 if low is None else 2)
        self.register_buffer("codes", codes, persistent=False)
        self.register_buffer("scale", scale, persistent=False)
        self.register_buffer("offset", offset, persistent=False)

    @classmethod
    def of(cls, blocks: "Blocks") -> "KeptWeights":
        from .ggufblocks import FOUR_BITS, SPAN, pack

        offset = None if blocks.offset is None else torch.from_numpy(blocks.offset)
        low, span = FOUR_BITS.get(blocks.kind), SPAN.get(blocks.kind, 0)
        codes = blocks.codes if low is None or blocks.packed else pack(blocks.codes, low, span)
        return cls(torch.from_numpy(codes), torch.from_numpy(blocks.scale), offset, blocks.group, low, span)

    def _grouped(self, held: torch.Tensor) -> torch.Tensor:
        """Rows of `codes` as integer codes (n, groups, group): unpacked into a scratch tensor
        where they are kept two a byte."""
        n, groups = held.shape[0], self.cols // self.group
        if self.low is None:
            return held.view(n, groups, self.group)
        runs = self.cols // (2 * self.span)
        out = _buffer(held.device, torch.uint8, n * self.cols).view(n, runs, 2, self.span)
        packed = held.view(n, runs, self.span)
        torch.bitwise_and(packed, 0x0F, out=out[:, :, 0, :])
        torch.bitwise_right_shift(packed, 4, out=out[:, :, 1, :])
        if self.low:
            out.sub_(-self.low if self.low < 0 else 256 - self.low)  # wraps: read as int8, code + low
            return out.view(torch.int8).view(n, groups, self.group)
        return out.view(n, groups, self.group)

    @property
    def stored_bytes(self) -> int:
        held = [self.codes, self.scale] + ([self.offset] if self.offset is not None else [])
        return sum(t.numel() * t.element_size() for t in held)

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
            target = out[at - start:end - start].view(n, groups, self.group) if wide else \
                _buffer(self.codes.device, torch.float32, n * cols).view(n, groups, self.group)
            codes = self._grouped(self.codes[at:end])
            torch.mul(codes, self.scale[at:end].unsqueeze(-1), out=target)
            if self.offset is not None:
                target.add_(self.offset[at:end].unsqueeze(-1))
            if not wide:
                out[at - start:end - start].copy_(target.view(n, cols))
        return out

    def lookup(self, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """The rows `ids` names, in `dtype` (an embedding's look-up)."""
        flat = ids.reshape(-1)
        values = self._grouped(self.codes[flat]) * self.scale[flat].unsqueeze(-1)
        if self.offset is not None:
            values = values + self.offset[flat].unsqueeze(-1)
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
