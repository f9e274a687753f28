"""A converted model's weights read straight into the precision they compute in, a slice at a time.

`from_pretrained` on a float32 copy asked for bfloat16 holds the float32 tensors (mapped file pages
count as resident) beside the bfloat16 ones: 4.2 GB resident for a 0.5B model whose bfloat16
weights take 1.26 GB. Here the model is built without weights, each parameter is allocated in its
dtype and filled from the file with plain reads of at most CHUNK_BYTES, cast as they arrive (the
same rounding as `Tensor.to`), so the peak is the weights in their dtype and one chunk.

Only folders prefixcache wrote itself (converted GGUF files) are read this way, and only when the
file's tensors are exactly the model's parameters, with their shapes; otherwise `None` (the caller
uses `from_pretrained`).

Example:
    model = load_lean(Path(converted), torch.bfloat16)   # None: not a layout read this way
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

from .safetensorsfile import safetensors_header

if TYPE_CHECKING:
    import torch
    from transformers import PreTrainedModel

log = logging.getLogger(__name__)


def with_attention(make: Callable[[str], PreTrainedModel]) -> PreTrainedModel:
    """`make(attention)` with PyTorch SDPA, or with the model's own eager attention where its
    architecture has no SDPA support."""
    try:
        return make("sdpa")
    except ValueError as exc:
        message = str(exc).lower()
        if "sdpa" not in message and "scaled_dot_product_attention" not in message:
            raise
        return make("eager")


def empty_model(config: Any, dtype: "torch.dtype") -> "PreTrainedModel":
    """The model of `config` with its parameters not yet allocated (on the meta device) and its
    computed buffers (rotary frequencies) real."""
    from accelerate import init_empty_weights
    from transformers import AutoModelForCausalLM

    def empty(attention: str) -> "PreTrainedModel":
        with init_empty_weights(include_buffers=False):
            return AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation=attention)

    return with_attention(empty)


CHUNK_BYTES = 16 << 20  # read and cast this much of a tensor at a time
HEADER_MAX = 100 << 20  # a safetensors header larger than this is not one prefixcache wrote


def load_lean(folder: Path, dtype: "torch.dtype", settle: Callable[[str, Any], None] | None = None
              ) -> "PreTrainedModel | None":
    """The folder's model (config.json and *.safetensors) with its weights in `dtype`, or None
    where its tensors are not exactly the model's parameters. `settle(name, module)` is called
    with each module once its own weights are in (int8 quantises a layer there, before the next
    is read)."""
    import torch
    from transformers import AutoConfig

    files = sorted(folder.glob("*.safetensors"))
    if not files:
        return None
    tensors = {}
    for path in files:
        header, start = safetensors_header(path, HEADER_MAX)
        tensors.update({name: (path, meta, start) for name, meta in header.items()})
    model = empty_model(AutoConfig.from_pretrained(str(folder)), dtype)
    if not _same_layout(model, tensors):
        return None
    for module_name, module in list(model.named_modules()):
        filled = False
        for leaf, _ in list(module.named_parameters(recurse=False)):
            name = f"{module_name}.{leaf}" if module_name else leaf
            if name not in tensors:
                continue  # tied to one that is (the output head to the embeddings), or missing: seen below
            path, meta, start = tensors[name]
            weights = torch.empty(meta["shape"], dtype=dtype)
            _read_into(weights, path, start + meta["data_offsets"][0], meta["dtype"])
            module._parameters[leaf] = torch.nn.Parameter(weights, requires_grad=False)
            filled = True
        if filled and settle is not None:
            settle(module_name, module)
    model.tie_weights()
    missing = [name for name, param in model.named_parameters() if param.device.type == "meta"]
    if missing:
        log.debug("lean load: parameters the file does not hold: %s", missing[:5])
        return None
    return model.eval()


def _same_layout(model: "PreTrainedModel", tensors: dict) -> bool:
    """Each of the file's tensors one of the model's parameters, with its shape and a dtype read here."""
    params = dict(model.named_parameters(remove_duplicate=False))
    for name, (_, meta, _) in tensors.items():
        if name not in params or list(meta["shape"]) != list(params[name].shape) or meta["dtype"] not in _SOURCES:
            log.debug("lean load: %s is not a parameter of the model as it is in the file", name)
            return False
    return True


_SOURCES = {"F32": "float32", "BF16": "bfloat16", "F16": "float16"}


def _read_into(out: "torch.Tensor", path: Path, offset: int, source: str) -> None:
    """Fill `out` from `path` at `offset` (a tensor of `source` dtype, as many values as `out`),
    CHUNK_BYTES at a time, cast on the way."""
    import torch

    src_dtype = getattr(torch, _SOURCES[source])
    item = torch.empty((), dtype=src_dtype).element_size()
    flat = out.view(-1)
    per_chunk = max(1, CHUNK_BYTES // item)
    buffer = bytearray(min(per_chunk, flat.numel()) * item)
    with open(path, "rb", buffering=0) as f:
        f.seek(offset)
        for at in range(0, flat.numel(), per_chunk):
            count = min(per_chunk, flat.numel() - at)
            view, filled = memoryview(buffer)[: count * item], 0
            while filled < len(view):
                got = f.readinto(view[filled:])
                if not got:
                    raise ValueError(f"{path.name}: ends inside a tensor")
                filled += got
            flat[at: at + count].copy_(torch.frombuffer(buffer, dtype=src_dtype, count=count))


