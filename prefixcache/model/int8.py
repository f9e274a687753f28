"""`--dtype int8`: the transformers engine's linear layers with int8 weights and int8 activations.

Each linear layer but the output head keeps its weights as int8 with one scale per output channel,
and quantises its input on the fly with one scale per token (torchao's dynamic int8 scheme): the
matrix product runs on the CPU's int8 dot-product units (AVX-512 VNNI, AVX-VNNI, AMX) or a GPU's
int8 tensor cores, accumulating exactly in int32. A token's scale is its own, yet an item's numbers
move a little with the items batched beside it: a last-bit difference in a float sum elsewhere can
carry a value across an int8 step (the output's fingerprint says so). The output head stays in float32: the log-probability
of a label token is read from it, and it is a small share of the work on models that answer well.

Example:
    model = load_model(source, tokenizer, cache_dir, "cpu", torch.float32)
    quantise(model)   # in place; the engine then says its precision is "int8"
"""

from __future__ import annotations

import logging
from types import ModuleType
from typing import TYPE_CHECKING

from .. import compat
from ..errors import ModelError

if TYPE_CHECKING:
    from transformers import PreTrainedModel

log = logging.getLogger(__name__)

INSTALL = "pip install 'prefixcache[int8]' (torchao)"
PRECISION = "int8"
KEPT_FLOAT = ("lm_head",)  # module names kept in float32: the head the label scores are read from


def installed() -> bool:
    """Whether torchao can be imported, without importing it (and torch with it)."""
    from importlib.util import find_spec

    return find_spec("torchao") is not None


def _torchao() -> tuple:
    """torchao's quantize_ and the int8 config; ModelError in one line where they cannot be had."""
    if not installed():
        raise ModelError(f"--dtype int8 needs torchao: {INSTALL}")
    try:
        with compat.quiet_loggers():
            from torchao.quantization import Int8DynamicActivationInt8WeightConfig, quantize_
    except Exception as exc:  # noqa: BLE001 - a torchao built for another torch: one line
        raise ModelError(f"--dtype int8: torchao cannot be used with this torch ({type(exc).__name__}: "
                         f"{str(exc).splitlines()[0][:160] if str(exc) else ''})")
    return quantize_, Int8DynamicActivationInt8WeightConfig()


def quantise(model: "PreTrainedModel") -> int:
    """Replace the weights of every linear layer but the output head by int8 ones, in place;
    returns how many layers were quantised. Raises ModelError in one line where it cannot."""
    import torch

    quantize_, config = _torchao()
    chosen = [name for name, module in model.named_modules() if _quantised(name, module, torch)]
    if not chosen:
        raise ModelError("--dtype int8: the model has no linear layers to quantise")
    wanted = set(chosen)
    quantize_(model, config, filter_fn=lambda module, name: name in wanted)
    from .heap import give_back_freed

    give_back_freed()  # the float32 weights the int8 ones replaced
    return _quantised_model(model, len(chosen))


class LayerQuantiser:
    """Quantises each linear layer (but the output head) as it is loaded, so a float32 copy of the
    whole model is never held (model/lean.py calls it with each module whose weights it filled).

    Example:
        each = LayerQuantiser()
        model = load_lean(folder, torch.float32, each)
        each.finish(model)
    """

    def __init__(self) -> None:
        self._quantize, self._config = _torchao()
        self.count = 0

    def __call__(self, name: str, module: object) -> None:
        import torch

        if _quantised(name, module, torch):
            self._quantize(module, self._config, filter_fn=lambda m, fqn: m is module)
            self.count += 1
            from .heap import trim_heap

            trim_heap()  # the layer's float32 weights, freed: else the heap keeps them (3.5 GB, not 2.1)

    def finish(self, model: "PreTrainedModel") -> bool:
        """Mark the model as int8 when its layers were quantised here (else `quantise` does it)."""
        if not self.count:
            return False
        _quantised_model(model, self.count)
        return True


def _quantised_model(model: "PreTrainedModel", count: int) -> int:
    setattr(model, "_prefixcache_precision", PRECISION)  # what the engine says it computes in
    log.info("int8: %d linear layers quantised (weights per channel, activations per token)", count)
    return count


def _quantised(name: str, module: object, torch: ModuleType) -> bool:
    """A linear layer to quantise: any but the output head."""
    return isinstance(module, torch.nn.Linear) and name.split(".")[-1] not in KEPT_FLOAT


def precision_of(model: "PreTrainedModel") -> str | None:
    """"int8" for a model `quantise` changed, else None (its parameters' dtype says it)."""
    return getattr(model, "_prefixcache_precision", None)
