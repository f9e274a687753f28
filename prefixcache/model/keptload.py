"""A GGUF file's model built with its quantised weights kept (model/kept.py), never converted.

The model is built without weights; each tensor is read from the file with plain reads, a slice
of rows at a time: a linear layer's or an embedding's weight in a format model/ggufblocks.py
reads becomes kept codes and factors, any other tensor (norms, biases, other formats) is
dequantised by gguf and cast to the precision, after the architecture's own processing, as
transformers converts it. The peak is the kept weights and one slice: for a 1.5B model at
Q4_K_M, about 1.9 GB where its float32 conversion needed 7 GB and its bfloat16 copy 3.1.

The kept tensors are shared by every model of the same file in the process (the float32 twin of
`--exact` and the bfloat16 model it checks hold one copy).

A model whose linear and embedding weights take EXPAND_BELOW or less in its precision (the
embedded 135M model: 0.54 GB in float32) has them expanded once as it loads instead, into plain
layers: the same values, computed without an expansion a forward.

`None` where the file is not read this way (an architecture whose processing is more than
reordering rows, a tensor the model does not have): the caller converts it as before.

Example:
    model = load_kept(Path("model.gguf"), config, torch.bfloat16)
"""

from __future__ import annotations

import logging
import os
import weakref
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from .. import compat
from .ggufblocks import FORMATS, decode, kept_size
from .ggufheader import TensorInfo, gguf_layout

if TYPE_CHECKING:
    import torch
    from transformers import PretrainedConfig, PreTrainedModel

    from .kept import KeptWeights

log = logging.getLogger(__name__)

SLICE_BYTES = 4 << 20  # raw bytes read and decoded at a time (the load's transient: a few times this)
ROW_ORDER = ("TensorProcessor", "LlamaTensorProcessor", "Gemma2TensorProcessor")  # at most reorder a weight's rows

# a model whose linear and embedding weights take this much or less in its dtype has them expanded once, as
# it loads: the expansion of every forward costs what a small model's few hundred MB do not
EXPAND_BELOW = 600 << 20
_shared: "weakref.WeakValueDictionary[tuple, _Store]" = weakref.WeakValueDictionary()  # file version -> its store


class _Store(dict):
    """The kept weights of one file version (weakly shared between models)."""


def load_kept(path: Path, config: "PretrainedConfig", dtype: "torch.dtype") -> "PreTrainedModel | None":
    """The file's model with its linear and embedding weights kept quantised, the rest in `dtype`;
    None where the file is not read this way."""
    import torch
    from transformers.modeling_gguf_pytorch_utils import TENSOR_PROCESSORS, TensorProcessor, get_gguf_hf_weights_map

    from .lean import empty_model

    layout = gguf_layout(path)
    if not reads(layout.architecture):
        return None
    processor = TENSOR_PROCESSORS.get(layout.architecture, TensorProcessor)(config=config.to_dict())
    model = empty_model(config, dtype)
    with compat.gguf_parsed_once():  # gguf's name map built once, not once a module (6.8 s for 135M)
        names = get_gguf_hf_weights_map(model, processor)
    modules = dict(model.named_modules())
    store = _store(path)
    kept: dict[str, KeptWeights] = {}
    with open(path, "rb", buffering=0) as f:
        for tensor in layout.tensors:
            target = names.get(tensor.name)
            if target is None:
                continue
            module_name, leaf = target.rsplit(".", 1) if "." in target else ("", target)
            module = modules.get(module_name)
            if module is None:
                return None
            at = layout.data_start + tensor.offset
            if leaf == "weight" and type(module) in (torch.nn.Linear, torch.nn.Embedding) and kept_bytes_of(tensor) is not None:
                weights = _shareable(store.get(tensor.name)) or _read_kept(f.fileno(), at, tensor, processor)
                if weights is None:
                    return None
                store[tensor.name] = kept[module_name] = weights
            else:
                values = _read_dense(f.fileno(), at, tensor, processor, names)
                if values is None:
                    return None
                module._parameters[leaf] = torch.nn.Parameter(torch.from_numpy(values).to(dtype), requires_grad=False)
    return _assemble(model, modules, kept, dtype, path, store)


def _store(path: Path) -> _Store:
    """The kept weights of this version of the file that a model still holds, shared."""
    st = path.stat()
    key = (str(path.resolve()), st.st_size, st.st_mtime_ns)
    store = _shared.get(key)
    if store is None:
        store = _shared[key] = _Store()
    return store


def _shareable(weights: "KeptWeights | None") -> "KeptWeights | None":
    """Kept weights a new model may share: those still on the CPU, where every model loads (a
    model moved to a GPU took its kept weights with it; one loaded after it reads its own)."""
    return weights if weights is not None and weights.codes.device.type == "cpu" else None


def kept_bytes_of(tensor: TensorInfo) -> int | None:
    """Bytes a 2-D tensor takes kept as codes and factors; None where it is not kept (a format not
    read as codes, or not 2-D)."""
    import gguf

    if len(tensor.shape) != 2:
        return None
    return kept_size(gguf.GGMLQuantizationType(tensor.kind).name, tensor.shape[1], tensor.shape[0])


def reads(architecture: str) -> bool:
    """Whether a GGUF file of this architecture is read with its weights kept: its processing in
    transformers does at most reorder a weight's rows."""
    from transformers.modeling_gguf_pytorch_utils import TENSOR_PROCESSORS, TensorProcessor

    return TENSOR_PROCESSORS.get(architecture, TensorProcessor).__name__ in ROW_ORDER


def _read_kept(fd: int, at: int, tensor: TensorInfo, processor: Any) -> "KeptWeights | None":
    """A weight's codes and factors, read a slice of rows at a time into tensors allocated once,
    its rows in the model's order."""
    import gguf
    import torch

    from .kept import KeptWeights

    kind = gguf.GGMLQuantizationType(tensor.kind).name
    cols, rows = tensor.shape
    order = _row_order(processor, tensor.name, rows)
    if order is False:
        return None
    per_block, size, _, _ = FORMATS[kind]
    row_bytes = cols // per_block * size
    step = max(1, SLICE_BYTES // row_bytes)
    held: dict[str, torch.Tensor | None] = {}
    group = 0
    for start in range(0, rows, step):
        count = min(step, rows - start)
        part = decode(os.pread(fd, count * row_bytes, at + start * row_bytes), kind, count, cols, packed=True)
        if part is None:
            return None
        arrays = part.arrays()
        if not held:
            group = part.group
            held = {name: None if a is None else torch.empty((rows, *a.shape[1:]), dtype=torch.from_numpy(a[:0]).dtype)
                    for name, a in arrays.items()}
        for name, values in arrays.items():
            into = held[name]
            if into is not None and values is not None:
                into[start:start + count] = torch.from_numpy(values)
    if order is not None:
        index = torch.from_numpy(order)
        held = {name: None if t is None else t[index] for name, t in held.items()}
    return KeptWeights(held, group, kind)


def _row_order(processor: Any, name: str, rows: int) -> np.ndarray | None | bool:
    """How the architecture's processing reorders this weight's rows: None (it does not), the
    order, or False where it does more than reorder them."""
    index = np.arange(rows, dtype=np.int64).reshape(rows, 1)
    result = processor.process(weights=index, name=name)
    moved = np.asarray(result.weights)
    if result.name != name or moved.shape != (rows, 1) or not np.array_equal(np.sort(moved[:, 0]), index[:, 0]):
        return False
    return None if np.array_equal(moved[:, 0], index[:, 0]) else np.ascontiguousarray(moved[:, 0])


def _read_dense(fd: int, at: int, tensor: TensorInfo, processor: Any, names: dict) -> np.ndarray | None:
    """A tensor dequantised by gguf and processed as transformers converts it (float32)."""
    import gguf
    from gguf.quants import dequantize

    kind = gguf.GGMLQuantizationType(tensor.kind)
    count = int(np.prod(tensor.shape))
    per_block, size = gguf.GGML_QUANT_SIZES[kind]
    raw = np.frombuffer(os.pread(fd, count // per_block * size, at), dtype=np.uint8)
    values = dequantize(raw, kind).reshape(tuple(reversed(tensor.shape)))
    result = processor.process(weights=values, name=tensor.name, tensor_key_mapping=names,
                               parsed_parameters={"tensors": {}, "config": processor.config})
    if result.name != tensor.name:
        return None
    return np.array(result.weights, dtype=np.float32, order="C", copy=True)


def _assemble(model: "PreTrainedModel", modules: dict, kept: dict, dtype: "torch.dtype", path: Path,
              store: _Store) -> "PreTrainedModel | None":
    """Put the kept layers in place of the model's, tie an output head the file does not hold to
    the embedding, and check that every parameter was read."""
    import torch

    from .kept import KeptEmbedding, KeptLinear

    head = model.get_output_embeddings()
    head_name = next((n for n, m in modules.items() if m is head), None)
    embedding_name = next((n for n, m in modules.items() if m is model.get_input_embeddings()), None)
    if head_name is not None and head_name not in kept and getattr(model.config, "tie_word_embeddings", False) \
            and getattr(head, "bias", None) is None:
        if embedding_name in kept:
            kept[head_name] = kept[embedding_name]
        else:
            model.tie_weights()
    unique = {id(w): w for w in kept.values()}.values()
    if sum(w.rows * w.cols for w in unique) * torch.empty((), dtype=dtype).element_size() <= EXPAND_BELOW:
        expanded = {id(w): torch.nn.Parameter(w.expand(0, w.rows, dtype, torch.empty((w.rows, w.cols), dtype=dtype)),
                                              requires_grad=False) for w in unique}
        for name, weights in kept.items():
            modules[name].weight = expanded[id(weights)]  # a tied head gets its embedding's Parameter
        return _checked(model, path, None)
    for name, weights in kept.items():
        old = modules[name]
        if isinstance(old, torch.nn.Embedding):
            new: torch.nn.Module = KeptEmbedding(weights, dtype)
        else:
            bias = old.bias
            new = KeptLinear(weights, bias if bias is not None else None)
        parent_name, _, leaf = name.rpartition(".")
        setattr(modules[parent_name] if parent_name else model, leaf, new)
    return _checked(model, path, store)


def _checked(model: "PreTrainedModel", path: Path, store: _Store | None) -> "PreTrainedModel | None":
    """The model, once every parameter was read (else None); `store`: its kept weights, held
    while the model is, so that a later load of the file shares them."""
    missing = [n for n, p in model.named_parameters() if p.device.type == "meta"]
    if missing:
        log.debug("kept load of %s: parameters the file does not hold: %s", path.name, missing[:5])
        return None
    setattr(model, "_prefixcache_kept", store)
    return model.eval()
