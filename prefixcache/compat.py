"""Every place prefixcache relies on a private or unstable part of torch, transformers or the hub
client, in one list. Each has a test in tests/test_compat.py that fails, naming the touchpoint,
when an upgrade breaks it. Nothing here runs on import: torch and transformers are imported by
the functions that need them.

| touchpoint                                                   | used for                               |
|--------------------------------------------------------------|----------------------------------------|
| torch.ops.aten._scaled_dot_product_flash_attention_for_cpu   | attention with its log-sum-exp (CPU)   |
| transformers.integrations.sdpa_attention.sdpa_attention_forward | outside scoring, plain SDPA         |
| PreTrainedModel._can_set_attn_implementation()               | may the model take our attention       |
| PretrainedConfig._attn_implementation (set and restored)     | switch attention for one forward       |
| huggingface_hub cache layout (snapshots/<commit>/)           | the hub revision actually loaded       |
| forward kwarg `cache` / `past_key_values`                    | passing a cache (being renamed)        |
| DynamicCache(list of (keys, values)), cache.layers[i].keys   | building and reading KV caches         |
| modeling_gguf_pytorch_utils.tqdm                             | GGUF conversion's progress bar         |
| PreTrainedModel.hf_quantizer, config.quantization_config     | saving dequantised GGUF weights        |
| /proc/cpuinfo flags amx_bf16, avx512_bf16                    | is bfloat16 matmul fast on this CPU    |
| typer._click.exceptions (UsageError, NoArgsIsHelpError)      | usage errors as one line (typer ships its own click) |
| the output embeddings called on the kept positions' states   | hidden states where tokens are scored  |
| base_model.layers / .h, a decoder layer's output, last_hidden_state | middle layers' and pooled states |
| chat_template_utils.ImmutableSandboxedEnvironment, _compile_jinja_template | chat templates rendered within bounds |
"""

from __future__ import annotations

import functools
import inspect
import logging as std_logging
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterator, Literal, Sequence

if TYPE_CHECKING:  # imported when a model is at hand, never on import
    import torch
    from transformers import PretrainedConfig, PreTrainedModel


@functools.cache
def flash_attention_cpu() -> Callable | None:
    """PyTorch's fused CPU flash-attention op, which also returns the log-sum-exp; None if gone.
    Called as op(q, k, v, dropout, is_causal, attn_mask=, scale=) -> (out, lse, ...)."""
    import torch

    return getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)


def sdpa_forward() -> Callable:
    """transformers' own SDPA attention function (the default a model would use)."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    return sdpa_attention_forward


def can_set_attention(model: PreTrainedModel) -> bool:
    """Whether the model dispatches attention through transformers' AttentionInterface."""
    return bool(getattr(model, "_can_set_attn_implementation", lambda: False)())


@contextmanager
def attention_implementation(config: PretrainedConfig, name: str) -> Iterator[None]:
    """Run the model's forwards with the registered attention `name`, then restore it."""
    previous = config._attn_implementation
    config._attn_implementation = name
    try:
        yield
    finally:
        config._attn_implementation = previous


def hub_revision(repo_id: str, cache_dir: str | None = None) -> str | None:
    """The commit of a hub model's files in the local hub cache: what `from_pretrained` just
    loaded (None when the files are not in the cache)."""
    from huggingface_hub import try_to_load_from_cache

    path = try_to_load_from_cache(repo_id, "config.json", cache_dir=cache_dir)
    parts = Path(path).parts if isinstance(path, str) else ()
    return parts[parts.index("snapshots") + 1] if "snapshots" in parts[:-1] else None


@contextmanager
def scored_states(model: PreTrainedModel, into: list) -> Iterator[None]:
    """Append to `into` the input of the model's output embeddings (the lm_head) at each forward
    within: the final hidden state, after the last norm, at exactly the positions whose logits
    `logits_to_keep` keeps ([B, K, H]). Costs nothing: the forward computes it anyway."""
    head = model.get_output_embeddings()
    handle = head.register_forward_pre_hook(lambda module, args: into.append(args[0].detach()))
    try:
        yield
    finally:
        handle.remove()


class NoLayers(Exception):
    """The model's decoder layers cannot be found: only the final state at answer positions is read."""


def decoder_layers(model: PreTrainedModel) -> Sequence[Any]:
    """The model's decoder layers, in order (`layers` in the Llama family, `h` in GPT-2)."""
    base = model.base_model
    for name in ("layers", "h"):
        found = getattr(base, name, None)
        if found is not None and len(found):
            return found
    raise NoLayers(f"{type(model).__name__} has no decoder layers where prefixcache looks for them")


@contextmanager
def layer_states(model: PreTrainedModel, layers: Sequence[int | None], into: dict) -> Iterator[None]:
    """Within, each forward sets `into[i]` to the residual stream after decoder layer i (from 1)
    at every position, and `into[None]` to the final state after the last norm (what the lm_head
    reads, before `logits_to_keep` slices it): [B, T, H] each. Raises NoLayers before any hook."""
    def keep(key: int | None) -> Callable:
        def hook(module: Any, args: Any, output: Any) -> None:
            found = getattr(output, "last_hidden_state", None) if key is None else None
            into[key] = (found if found is not None else output[0] if isinstance(output, tuple) else output).detach()
        return hook

    handles = []
    try:
        stack = decoder_layers(model) if any(i is not None for i in layers) else ()
        for i in layers:
            module = model.base_model if i is None else stack[i - 1]
            handles.append(module.register_forward_hook(keep(i)))
        yield
    finally:
        for handle in handles:
            handle.remove()


def cache_kwarg(model: PreTrainedModel) -> str:
    """The forward's name for the KV cache argument: `cache` in newer releases."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


def cache_from(kv: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> Any:
    """A DynamicCache holding these per-layer (keys, values); empty for an empty sequence."""
    from transformers import DynamicCache

    return DynamicCache(list(kv)) if kv else DynamicCache()


def cache_layers(cache: Any) -> tuple[tuple[Any, Any], ...]:
    """Per-layer (keys, values) of a cache a forward returned; () for caches of other kinds."""
    return tuple((layer.keys, layer.values) for layer in getattr(cache, "layers", ()))


def returned_cache(output: Any) -> Any:
    return getattr(output, "cache", None) or getattr(output, "past_key_values", None)


_GGUF_PARSED: dict[tuple, Any] = {}  # the last GGUF file parsed, kept from its tokenizer's load to its conversion


def gguf_reader(path: Any, mode: Literal["r", "r+", "c"] = "r") -> Any:
    """gguf's `GGUFReader` of `path`, 3-4x faster: it parses the header through a plain array
    over the mapped file where gguf slices a `numpy.memmap`, whose every slice (one or more for
    each of 150k vocabulary strings) runs Python code. The same fields and tensors; each tensor's
    data is still a view of the mapped file, read only where used."""
    import numpy as np
    from gguf.gguf_reader import GGUFReader  # the class itself, even within gguf_parsed_once

    class PlainReader(GGUFReader):
        @property
        def data(self) -> Any:
            return self._plain

        @data.setter
        def data(self, value: Any) -> None:
            self._plain = value.view(np.ndarray) if isinstance(value, np.memmap) else value

    return PlainReader(path, mode)


@contextmanager
def gguf_parsed_once(keep: bool = False) -> Iterator[None]:
    """transformers parses a GGUF file's metadata anew for the tokenizer, the config and the
    weights (seconds each for the embedded model's 49k-token vocabulary) and builds gguf's
    tensor-name map once per tensor: within this block a file is parsed once and each map built
    once. `keep`: the parse outlives the block (a tokenizer's load, before the conversion that
    reads the same file); otherwise it is dropped at the end."""
    import gguf

    real_reader, real_map = gguf.GGUFReader, gguf.get_tensor_name_map
    maps: dict[tuple, Any] = {}

    def reader(path: Any, mode: Literal["r", "r+", "c"] = "r") -> Any:
        found = Path(path)
        stat = found.stat()
        key = (str(found.resolve()), stat.st_size, stat.st_mtime_ns, mode)
        if key not in _GGUF_PARSED:
            _GGUF_PARSED.clear()  # one file at a time
            _GGUF_PARSED[key] = gguf_reader(path, mode)
        return _GGUF_PARSED[key]

    def name_map(arch: Any, n_blocks: int) -> Any:
        if (arch, n_blocks) not in maps:
            maps[arch, n_blocks] = real_map(arch, n_blocks)
        return maps[arch, n_blocks]

    setattr(gguf, "GGUFReader", reader)
    setattr(gguf, "get_tensor_name_map", name_map)
    try:
        yield
    finally:
        setattr(gguf, "GGUFReader", real_reader)
        setattr(gguf, "get_tensor_name_map", real_map)
        if not keep:
            _GGUF_PARSED.clear()


def drop_gguf_parse() -> None:
    """Let go of a GGUF file's parse kept from its tokenizer's load (no conversion will read it)."""
    _GGUF_PARSED.clear()


@contextmanager
def gguf_progress_bar(enabled: bool) -> Iterator[None]:
    """transformers' GGUF conversion draws a tqdm bar that ignores its own progress-bar setting;
    this carries that setting over for the duration of a conversion."""
    from transformers import modeling_gguf_pytorch_utils as gguf_utils

    original = getattr(gguf_utils, "tqdm", None)
    if original is not None and not enabled:
        gguf_utils.tqdm = functools.partial(original, disable=True)
    try:
        yield
    finally:
        if original is not None:
            gguf_utils.tqdm = original


def chat_template_environment(environment: type) -> None:
    """transformers compiles chat templates in `environment` (a subclass of jinja2's immutable
    sandbox) from now on; the templates it compiled before are forgotten."""
    from transformers.utils import chat_template_utils as templates

    if templates.ImmutableSandboxedEnvironment is not environment:
        setattr(templates, "ImmutableSandboxedEnvironment", environment)
        templates._compile_jinja_template.cache_clear()


def progress_bars_enabled() -> bool:
    from transformers.utils import logging

    return logging.is_progress_bar_enabled()


def drop_quantizer(model: PreTrainedModel) -> None:
    """Mark dequantised GGUF weights as plain floats, so a saved copy loads as such."""
    setattr(model, "hf_quantizer", None)
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config


def quiet_libraries() -> None:
    """Process-wide: transformers' and the hub client's advice and progress bars off. For
    programs that own stderr (the CLI); the library itself never calls it."""
    from transformers.utils import logging

    logging.set_verbosity_error()
    logging.disable_progress_bar()
    for name in NOISY_IMPORTS:
        std_logging.getLogger(name).setLevel(std_logging.ERROR)
    try:  # the hub client's retry chatter, when the network is down
        from huggingface_hub.utils import logging as hub_logging

        hub_logging.set_verbosity_error()
    except ImportError:
        pass


# torchao's import (transformers imports it wherever it is installed) warns of the GPU kernels a CPU
# build cannot load, and torch of its Enum registrations: nothing a user can act on
NOISY_IMPORTS = ("torchao", "torch.utils._pytree")


@contextmanager
def quiet_loggers(names: Sequence[str] = NOISY_IMPORTS) -> Iterator[None]:
    """The named loggers below errors for the length of a block, then as they were."""
    levels = {name: std_logging.getLogger(name).level for name in names}
    for name in names:
        std_logging.getLogger(name).setLevel(std_logging.ERROR)
    try:
        yield
    finally:
        for name, level in levels.items():
            std_logging.getLogger(name).setLevel(level)


@contextmanager
def quietly() -> Iterator[None]:
    """transformers' advice and progress bars (and torchao's import warnings) off for the length
    of a block, then as they were: for the Python API, which prints nothing of its own but a bar
    it was asked for."""
    from transformers.utils import logging

    verbosity, bars = logging.get_verbosity(), logging.is_progress_bar_enabled()
    logging.set_verbosity_error()
    logging.disable_progress_bar()
    try:
        with quiet_loggers():
            yield
    finally:
        logging.set_verbosity(verbosity)
        if bars:
            logging.enable_progress_bar()


def cli_usage_errors() -> tuple[type[Any], type[Any]]:
    """(UsageError, NoArgsIsHelpError) of the click that typer runs on: typer vendors its own
    copy, whose classes are not the `click` package's."""
    import typer

    try:
        from typer._click.exceptions import NoArgsIsHelpError, UsageError
    except ImportError:  # a typer on the click package
        from click.exceptions import NoArgsIsHelpError, UsageError  # type: ignore[assignment]
    assert issubclass(typer.BadParameter, UsageError)
    return UsageError, NoArgsIsHelpError


def int8_matmul(device: str) -> bool:
    """Whether int8 matrix products are fast here: CUDA, or a CPU with AVX-512 VNNI, AVX-VNNI or
    AMX int8 instructions (read from /proc/cpuinfo; False where it cannot be told)."""
    if device.startswith("cuda"):
        return True
    return device.startswith("cpu") and bool(cpu_flags() & {"avx512_vnni", "avx_vnni", "amx_int8"})


def bf16_matmul(device: str) -> bool:
    """Whether bfloat16 matrix products are fast here: CUDA with bf16 support, or a CPU with AMX or
    AVX-512 BF16 instructions (read from /proc/cpuinfo; False where it cannot be told). Imports
    torch for CUDA alone: a run's plan asks it before anything loads."""
    if device.startswith("cuda"):
        import torch

        return torch.cuda.is_available() and torch.cuda.is_bf16_supported()
    return device.startswith("cpu") and bool(cpu_flags() & {"amx_bf16", "avx512_bf16"})


def cpu_flags() -> set[str]:
    """The CPU's instruction-set flags (/proc/cpuinfo's words; none where it cannot be read)."""
    try:
        return set(Path("/proc/cpuinfo").read_text().split())
    except OSError:
        return set()
