"""How much memory a model will take, said before it is loaded: its weights at the precision it
runs in, the keys and values of the prefilled prefix and of a batch, and, for a GGUF file not yet
converted, the conversion's peak; and how much memory this machine has available. Read from the
model's files alone (a GGUF file's tensor table, safetensors headers, config.json): nothing is
loaded.
"""

from __future__ import annotations

import functools
import json
import logging
import math
import os
from dataclasses import dataclass
from pathlib import Path

from .load import ModelSource, converted_dir
from .ggufheader import check_gguf
from .safetensorsfile import safetensors_header

log = logging.getLogger(__name__)
CONVERSION = 1.0  # a GGUF conversion's peak beyond the running model, over its float32 weights (measured 0.45)
RUNTIME = 400_000_000  # Python, torch and transformers themselves (measured: 0.40 GB before any model)
TOKENIZER_BYTES = 850  # a fast tokenizer's memory a token of its vocabulary (measured: 0.13 GB for 151,936 tokens)
GB = 1e9


@dataclass(frozen=True)
class Shape:
    """What the memory of a model depends on: its parameters and its key/value width per token."""

    parameters: int
    layers: int
    kv_heads: int
    head_dim: int
    vocab: int = 0  # tokens its tokenizer holds (0: not said)


@dataclass(frozen=True)
class Footprint:
    """A model's memory as it will run: `weights` (bytes at its precision), `kv` (the prefix's
    and a batch's keys and values), `conversion` (the extra peak of converting a GGUF file first;
    0 once converted), `runtime` (the program itself and the model's tokenizer)."""

    weights: int
    kv: int
    conversion: int = 0
    runtime: int = RUNTIME
    buffers: int = 0  # llama.cpp's compute buffers for one decode

    @property
    def total(self) -> int:
        return self.weights + self.kv + self.conversion + self.runtime + self.buffers

    def words(self) -> str:
        work = f", compute buffers {self.buffers / GB:.2f} GB" if self.buffers else ""
        said = (f"about {self.total / GB:.2f} GB (weights {self.weights / GB:.2f} GB, prefix and batch "
                f"{self.kv / GB:.2f} GB{work}, the runtime and tokenizer {self.runtime / GB:.2f} GB")
        return said + (f", converting the GGUF file first {self.conversion / GB:.2f} GB more)" if self.conversion else ")")


def footprint(source: ModelSource, cache_dir: Path, dtype_bytes: int, tokens: int, kept: bool = False
              ) -> Footprint | None:
    """The memory `source` will take at `dtype_bytes` a number with `tokens` positions of keys and
    values (the prefix and a batch); None when its files do not say (a hub model not downloaded).
    `kept`: a GGUF file read with its weights kept quantised where its architecture is
    (model/keptload.py): no conversion, its weights at the size they are kept in."""
    try:
        shape, converting = _shape(source, cache_dir)
        held = kept_weight_bytes(Path(source.path), dtype_bytes) if kept and source.kind == "gguf" else None
    except Exception as exc:  # noqa: BLE001 - an estimate is a courtesy: its failure is never the run's
        log.debug("no memory estimate for %s: %s", source.ref, exc)
        return None
    if shape is None:
        return None
    kv = 2 * shape.layers * shape.kv_heads * shape.head_dim * dtype_bytes * tokens
    runtime = RUNTIME + TOKENIZER_BYTES * shape.vocab
    if held is not None:
        return Footprint(held, kv, runtime=runtime)
    conversion = int(CONVERSION * 4 * shape.parameters) if converting else 0
    return Footprint(shape.parameters * dtype_bytes, kv, conversion, runtime=runtime)


def kept_weight_bytes(path: Path, dtype_bytes: int) -> int | None:
    """The bytes a GGUF file's weights take read with them kept quantised (the other tensors at
    `dtype_bytes` a number), from its header; None where its architecture is not read that way."""
    from .ggufheader import gguf_layout
    from .keptload import EXPAND_BELOW, kept_bytes_of, reads

    layout = gguf_layout(path)
    if not reads(layout.architecture):
        return None
    total = dense = expanded = 0
    for tensor in layout.tensors:
        as_dtype = math.prod(tensor.shape) * dtype_bytes
        size = kept_bytes_of(tensor)
        total += size if size is not None else as_dtype
        dense += as_dtype
        expanded += as_dtype if size is not None else 0
    return dense if expanded <= EXPAND_BELOW else total  # a small model is expanded as it loads


def llama_footprint(path: Path, cells: int, ubatch: int, kv_bytes: int = 2) -> Footprint | None:
    """The memory llama.cpp will take for the GGUF file at `path`: the file as read (its weights at
    their own types), keys and values for `cells` positions at `kv_bytes` a number, and the compute
    buffers of a decode of `ubatch` tokens (attention scores over every cell, the logits, the
    feed-forward's activations; doubled, as measured)."""
    try:
        facts = gguf_facts(path)
    except Exception as exc:  # noqa: BLE001 - an estimate is a courtesy
        log.debug("no memory estimate for %s: %s", path, exc)
        return None
    shape = facts.shape
    kv = 2 * shape.layers * shape.kv_heads * shape.head_dim * kv_bytes * cells
    buffers = 2 * 4 * ubatch * (facts.heads * cells + shape.vocab + facts.ff)
    return Footprint(path.stat().st_size, kv, buffers=buffers, runtime=RUNTIME + TOKENIZER_BYTES * shape.vocab)


def float32_bytes(source: ModelSource, cache_dir: Path) -> int | None:
    """The model's weights as float32 (its parameters times 4), or None when its files do not say."""
    try:
        shape, _ = _shape(source, cache_dir)
    except Exception:  # noqa: BLE001 - not known: the caller decides without it
        return None
    return None if shape is None else 4 * shape.parameters


def available() -> int | None:
    """Bytes of memory this process may still take: what the machine has available now (Linux:
    MemAvailable), or less where its cgroup's memory limit leaves less (a container, a systemd
    unit's MemoryMax, a batch slot); None when neither is known."""
    return available_and_why()[0]


def available_and_why() -> tuple[int | None, str]:
    """`available()`, and what bounds it: "this machine" or "this process's cgroup (its memory limit)"."""
    machine = _machine_available()
    group = cgroup_headroom()
    if group is not None and (machine is None or group < machine):
        return group, "this process's cgroup (its memory limit)"
    return machine, "this machine"


def _machine_available() -> int | None:
    try:
        with open("/proc/meminfo", encoding="ascii") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError):
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def cgroup_headroom(membership: Path = Path("/proc/self/cgroup"), root: Path = Path("/sys/fs/cgroup")) -> int | None:
    """Bytes this process's cgroups let it take beyond what they hold now (the limit less the usage
    that cannot be reclaimed: usage less inactive file pages), the least over its cgroup and
    those above it; cgroup v2 (`root`, or `root`/unified beside v1) or v1 (`root`/memory). None
    without a limit (or off Linux)."""
    try:
        lines = membership.read_text(encoding="utf-8").splitlines()
    except OSError:
        return None
    found = []
    for line in lines:
        number, controllers, path = (line.split(":", 2) + ["", ""])[:3]
        if number == "0" and controllers == "":
            for mount in (root, root / "unified"):
                if (mount / "cgroup.controllers").exists():
                    found.append(_headroom(mount, path, "memory.max", "memory.current", "inactive_file"))
                    break
        elif "memory" in controllers.split(","):
            found.append(_headroom(root / "memory", path, "memory.limit_in_bytes", "memory.usage_in_bytes",
                                   "total_inactive_file"))
    known = [f for f in found if f is not None]
    return min(known) if known else None


NO_LIMIT = 1 << 60  # cgroup v1 says "no limit" with a number near 2**63


def _headroom(mount: Path, path: str, limit_file: str, usage_file: str, inactive_key: str) -> int | None:
    """The least headroom over the cgroup at `path` under `mount` and its ancestors."""
    best = None
    folder = mount / path.strip("/")
    while True:
        try:
            text = (folder / limit_file).read_text(encoding="ascii").strip()
            if text != "max" and int(text) < NO_LIMIT:
                usage = int((folder / usage_file).read_text(encoding="ascii"))
                room = int(text) - max(0, usage - _stat(folder / "memory.stat", inactive_key))
                best = room if best is None else min(best, room)
        except (OSError, ValueError):
            pass
        if folder == mount or mount not in folder.parents:
            return None if best is None else max(best, 0)
        folder = folder.parent


def _stat(path: Path, key: str) -> int:
    try:
        for line in path.read_text(encoding="ascii").splitlines():
            name, _, value = line.partition(" ")
            if name == key:
                return int(value)
    except (OSError, ValueError):
        pass
    return 0


def _shape(source: ModelSource, cache_dir: Path) -> tuple[Shape | None, bool]:
    """The model's shape, and whether a GGUF file has still to be converted."""
    if source.kind == "gguf":
        converted = converted_dir(source, cache_dir)
        if (converted / "config.json").exists():
            return _folder_shape(converted), False
        return _gguf_shape(Path(source.path)), True
    if source.kind == "dir":
        return _folder_shape(Path(source.path)), False
    return None, False


@dataclass(frozen=True)
class GgufFacts:
    """What a GGUF file's header says of the memory its model takes."""

    shape: Shape  # its vocab: the tokens of the file's vocabulary
    heads: int
    ff: int
    file_type: int | None  # general.file_type (0: every tensor float32), None when not said


def gguf_facts(path: Path) -> GgufFacts:
    """The file's facts, its header parsed once per file version (a parse takes ~0.5 s: the
    vocabulary is read in Python)."""
    check_gguf(Path(path))
    st = Path(path).stat()
    return _gguf_facts(str(path), st.st_mtime_ns, st.st_size)


@functools.lru_cache(maxsize=4)
def _gguf_facts(path: str, mtime_ns: int, size: int) -> GgufFacts:
    from .. import compat

    reader = compat.gguf_reader(path)

    def value(key: str) -> int | None:
        field = reader.fields.get(key)
        if field is None:
            return None
        got = field.contents()
        return int(max(got) if isinstance(got, list) else got)

    def needed(key: str) -> int:
        got = value(key)
        if got is None:
            raise ValueError(f"{path}: its header lacks {key}")
        return got

    arch = reader.fields["general.architecture"].contents()
    heads = needed(f"{arch}.attention.head_count")
    head_dim = value(f"{arch}.attention.key_length") or needed(f"{arch}.embedding_length") // heads
    tokens = reader.fields.get("tokenizer.ggml.tokens")
    vocab = value(f"{arch}.vocab_size") or (len(tokens.data) if tokens is not None else 0)
    shape = Shape(sum(int(t.n_elements) for t in reader.tensors), needed(f"{arch}.block_count"),
                  value(f"{arch}.attention.head_count_kv") or heads, head_dim, vocab)
    return GgufFacts(shape, heads, value(f"{arch}.feed_forward_length") or 0, value("general.file_type"))


def _gguf_shape(path: Path) -> Shape:
    return gguf_facts(path).shape


def _folder_shape(folder: Path) -> Shape | None:
    config = json.loads((folder / "config.json").read_text(encoding="utf-8"))
    config = config.get("text_config") or config
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        return None
    parameters = sum(_safetensors_parameters(f) for f in files)
    heads = config.get("num_attention_heads") or config.get("n_head")
    layers = config.get("num_hidden_layers") or config.get("n_layer")
    head_dim = config.get("head_dim") or (config.get("hidden_size") or config.get("n_embd")) // heads
    return Shape(parameters, layers, config.get("num_key_value_heads") or heads, head_dim, config.get("vocab_size") or 0)


def _safetensors_parameters(path: Path) -> int:
    """The numbers a safetensors file holds, from its header alone."""
    total = 0
    for tensor in safetensors_header(path)[0].values():
        count = 1
        for dim in tensor["shape"]:
            count *= dim
        total += count
    return total
