"""Llama-shaped models with random weights written as GGUF files, for tests and benchmarks.

The tokenizer (SmolLM2's: 49152 tokens, its chat template) is copied from the embedded model's
GGUF file, so transformers and llama.cpp read the same vocabulary; the weights are random and
written in GGUF's own layout, which both read as the same model.

As a script it writes a benchmark model of a realistic size and quantises it with llama.cpp's
own quantizer (needs llama-cpp-python):

    python tests/gguf_fixture.py 1.7b /tmp/bench-models      # F16 + Q8_0 + Q4_K_M files
    python tests/gguf_fixture.py 4b /tmp/bench-models --types Q4_K_M

Nothing here is shipped with the package.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np


@dataclass(frozen=True)
class Shape:
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    ff: int
    context: int = 8192

    def parameters(self, vocab: int = 49152) -> int:
        head_dim = self.hidden // self.heads
        attn = 2 * self.hidden * self.hidden + 2 * self.hidden * self.kv_heads * head_dim
        return vocab * self.hidden + self.layers * (attn + 3 * self.hidden * self.ff + 2 * self.hidden) + self.hidden


TINY = Shape(layers=2, hidden=64, heads=4, kv_heads=2, ff=128, context=2048)
SIZES = {
    "tiny": TINY,
    "1.7b": Shape(layers=24, hidden=2048, heads=32, kv_heads=32, ff=8192),  # SmolLM2-1.7B's shape
    "4b": Shape(layers=36, hidden=3072, heads=24, kv_heads=8, ff=8192),  # 3.8B parameters
}


def tokenizer_fields() -> list[tuple[str, object, object, object]]:
    """The embedded GGUF's tokenizer keys: (key, value, type, sub type) as GGUFWriter takes them."""
    import gguf

    from prefixcache.model.load import embedded_model_file

    reader = gguf.GGUFReader(str(embedded_model_file()))
    found = []
    for key, field in reader.fields.items():
        if key.startswith("tokenizer."):
            kind = field.types[0]
            sub = field.types[1] if len(field.types) > 1 else None
            found.append((key, field.contents(), kind, sub))
    return found


def write_gguf(path: Path, shape: Shape = TINY, seed: int = 0, scale: float = 0.08, f16: bool = False,
               chat_template: str | None = None, quant: tuple[str, ...] = ()) -> Path:
    """A Llama model of `shape` with random weights at `path` (F32, or F16 with `f16`), its chat
    template SmolLM2's or `chat_template`. `quant`: the 2-D weights quantised by gguf's own
    quantiser, taking these formats in turn ("Q4_0", "Q8_0", ...)."""
    import gguf

    rng = np.random.default_rng(seed)
    turn = iter(range(1 << 30))
    kind = np.float16 if f16 else np.float32
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_name("prefixcache random test model")
    writer.add_block_count(shape.layers)
    writer.add_context_length(shape.context)
    writer.add_embedding_length(shape.hidden)
    writer.add_feed_forward_length(shape.ff)
    writer.add_head_count(shape.heads)
    writer.add_head_count_kv(shape.kv_heads)
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_Q8_0 if quant else gguf.LlamaFileType.MOSTLY_F16 if f16
                         else gguf.LlamaFileType.ALL_F32)
    writer.add_rope_dimension_count(shape.hidden // shape.heads)
    fields = tokenizer_fields()
    vocab = next(len(v) for k, v, _, _ in fields if k == "tokenizer.ggml.tokens")
    writer.add_vocab_size(vocab)
    for key, value, kind_, sub in fields:
        if key == "tokenizer.chat_template" and chat_template is not None:
            value = chat_template
        writer.add_key_value(key, value, kind_, sub)

    def weight(*dims: int, std: float = scale) -> np.ndarray:
        return (rng.standard_normal(dims, dtype=np.float32) * std).astype(kind)

    def norm() -> np.ndarray:
        return (1.0 + 0.1 * rng.standard_normal(shape.hidden, dtype=np.float32)).astype(np.float32)

    add_plain = writer.add_tensor

    def add(name: str, values: np.ndarray) -> None:
        if not quant or values.ndim != 2:
            return add_plain(name, values)
        kind = gguf.GGMLQuantizationType[quant[next(turn) % len(quant)]]
        add_plain(name, gguf.quants.quantize(values.astype(np.float32), kind), raw_dtype=kind)

    writer.add_tensor = add  # type: ignore[method-assign]
    head_dim = shape.hidden // shape.heads
    writer.add_tensor("token_embd.weight", weight(vocab, shape.hidden, std=0.5))
    for i in range(shape.layers):
        out = 1.0 / np.sqrt(shape.hidden)
        writer.add_tensor(f"blk.{i}.attn_norm.weight", norm())
        writer.add_tensor(f"blk.{i}.attn_q.weight", weight(shape.heads * head_dim, shape.hidden, std=out))
        writer.add_tensor(f"blk.{i}.attn_k.weight", weight(shape.kv_heads * head_dim, shape.hidden, std=out))
        writer.add_tensor(f"blk.{i}.attn_v.weight", weight(shape.kv_heads * head_dim, shape.hidden, std=out))
        writer.add_tensor(f"blk.{i}.attn_output.weight", weight(shape.hidden, shape.heads * head_dim, std=out))
        writer.add_tensor(f"blk.{i}.ffn_norm.weight", norm())
        writer.add_tensor(f"blk.{i}.ffn_gate.weight", weight(shape.ff, shape.hidden, std=out))
        writer.add_tensor(f"blk.{i}.ffn_up.weight", weight(shape.ff, shape.hidden, std=out))
        writer.add_tensor(f"blk.{i}.ffn_down.weight", weight(shape.hidden, shape.ff, std=1.0 / np.sqrt(shape.ff)))
    writer.add_tensor("output_norm.weight", norm())
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


QUANT_TYPES = {"F32": 0, "F16": 1, "Q4_0": 2, "Q8_0": 7, "Q4_K_M": 15}  # llama.cpp's LLAMA_FTYPE_* numbers


def quantize(source: Path, target: Path, kind: str, threads: int = 0) -> Path:
    """`source` quantised to `kind` with llama.cpp's own quantizer."""
    import llama_cpp

    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = QUANT_TYPES[kind]
    params.nthread = threads
    params.allow_requantize = True  # a quantised source (the embedded Q4_1 file) is dequantised first
    if llama_cpp.llama_model_quantize(str(source).encode(), str(target).encode(), params) != 0:
        raise RuntimeError(f"llama.cpp could not quantise {source} to {kind}")
    return target


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Write a random Llama-shaped GGUF model and its quantisations.")
    parser.add_argument("size", choices=sorted(SIZES))
    parser.add_argument("folder", type=Path)
    parser.add_argument("--types", default="Q8_0,Q4_K_M", help="quantisations to make from the F16 file (comma list)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    args.folder.mkdir(parents=True, exist_ok=True)
    shape = SIZES[args.size]
    base = args.folder / f"random-{args.size}.F16.gguf"
    if not base.exists():
        print(f"writing {base} ({shape.parameters() / 1e9:.2f}B parameters)", file=sys.stderr)
        write_gguf(base.with_suffix(".part"), shape, args.seed, f16=True).rename(base)
    for kind in filter(None, args.types.split(",")):
        target = args.folder / f"random-{args.size}.{kind}.gguf"
        if not target.exists():
            print(f"quantising to {target}", file=sys.stderr)
            quantize(base, target, kind)
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    raise SystemExit(main())
