"""A GGUF file's weights kept quantised (model/ggufblocks.py, kept.py, keptload.py) against the slow,
obviously correct references: gguf's own dequantiser, dense layers over the expanded weights, and
the model converted to float weights."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from prefixcache.model import kept as kept_module
from prefixcache.model.ggufblocks import FORMATS, decode, kept_size, raw_size
from prefixcache.model.kept import KeptEmbedding, KeptLinear, KeptWeights, kept_bytes

HALVES = {"Q4_0": [0], "Q4_1": [0, 2], "Q5_0": [0], "Q5_1": [0, 2], "Q8_0": [0], "Q4_K": [0, 2],
          "Q5_K": [0, 2], "Q6_K": [208]}  # where each format's float16 factors sit in its block


def random_blocks(kind: str, rows: int, blocks_a_row: int, seed: int = 0) -> np.ndarray:
    """Random bytes in `kind`'s block layout, its float16 factors finite."""
    rng = np.random.default_rng(seed)
    _, size, _, _ = FORMATS[kind]
    raw = rng.integers(0, 256, (rows * blocks_a_row, size), dtype=np.uint8)
    for at in HALVES[kind]:
        raw[:, at:at + 2] = rng.normal(0, 0.05, len(raw)).astype(np.float16).view(np.uint8).reshape(-1, 2)
    return raw


@pytest.mark.parametrize("kind", sorted(FORMATS))
def test_each_format_s_codes_expand_to_gguf_s_own_values_bit_for_bit(kind):
    import gguf
    from gguf.quants import dequantize

    per_block = FORMATS[kind][0]
    raw = random_blocks(kind, rows=5, blocks_a_row=2)
    reference = dequantize(raw.reshape(-1), gguf.GGMLQuantizationType[kind]).reshape(5, 2 * per_block)
    blocks = decode(raw.tobytes(), kind, 5, 2 * per_block)
    assert blocks is not None and blocks.codes.dtype == np.int8
    assert np.array_equal(blocks.expand().view(np.uint32), reference.view(np.uint32))
    packed = decode(raw.tobytes(), kind, 5, 2 * per_block, packed=True)  # 4-bit codes as the file holds them
    assert packed is not None and np.array_equal(packed.expand().view(np.uint32), reference.view(np.uint32))
    if packed.packed:
        assert torch.equal(KeptWeights.of(packed).codes, KeptWeights.of(blocks).codes)
    kept = KeptWeights.of(blocks)
    assert kept.stored_bytes == kept_size(kind, 5, 2 * per_block)  # what the memory estimate counts
    assert kept.stored_bytes <= raw_size(kind, 5, 2 * per_block) * 1.06  # as small as the file, near enough
    assert (kept.low is None) == (kind == "Q8_0")  # codes under 8 bits two a byte
    for dtype in (torch.float32, torch.bfloat16):
        assert torch.equal(kept.expand(0, 5, dtype).clone(), torch.from_numpy(reference).to(dtype))


def test_a_format_not_read_or_a_tensor_of_the_wrong_size_is_said():
    assert decode(b"\0" * 10, "IQ2_XS", 1, 256) is None
    assert decode(b"\0" * 18, "Q4_0", 1, 48) is None  # a row that is not whole blocks
    with pytest.raises(ValueError, match="takes 36 bytes"):
        decode(b"\0" * 18, "Q4_0", 2, 32)


def _kept(kind: str, rows: int, cols: int, seed: int = 1) -> tuple[KeptWeights, torch.Tensor]:
    import gguf
    from gguf.quants import dequantize

    raw = random_blocks(kind, rows, cols // FORMATS[kind][0], seed)
    blocks = decode(raw.tobytes(), kind, rows, cols)
    assert blocks is not None
    return KeptWeights.of(blocks), torch.from_numpy(dequantize(raw.reshape(-1), gguf.GGMLQuantizationType[kind])
                                                    .reshape(rows, cols).copy())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_kept_layer_computes_what_the_dense_layer_of_its_values_computes(dtype, monkeypatch):
    """Whole, and a slice of rows at a time (an output head too large for one scratch tensor),
    with a bias: the same numbers, bit for bit, as `linear` over the weights in `dtype`."""
    weights, dense = _kept("Q4_K", 2000, 256)
    bias = torch.nn.Parameter(torch.randn(2000).to(dtype), requires_grad=False)
    x = torch.randn(3, 7, 256).to(dtype)
    want = torch.nn.functional.linear(x, dense.to(dtype).clone(), bias)  # torch-allocated, as a model holds it
    layer = KeptLinear(weights, bias)
    assert torch.equal(layer(x), want)
    monkeypatch.setattr(kept_module, "SCRATCH_MAX", 256 * x.element_size() * 900)  # 3 slices of 667 rows
    monkeypatch.setattr(kept_module, "CHUNK", 256 * 100)  # and 100 rows through float32 at a time
    assert torch.equal(layer(x), want)


def test_a_kept_embedding_looks_up_the_rows_of_its_values():
    weights, dense = _kept("Q6_K", 30, 256)
    ids = torch.tensor([[3, 0, 29, 3], [7, 7, 1, 2]])
    for dtype in (torch.float32, torch.bfloat16):
        assert torch.equal(KeptEmbedding(weights, dtype)(ids), dense.to(dtype)[ids])


@pytest.fixture(scope="module")
def quantised_gguf(tmp_path_factory):
    """A quantised GGUF file, its cache and its tokenizer (parsed once: 49k tokens)."""
    from gguf_fixture import write_gguf

    from prefixcache.model import load

    folder = tmp_path_factory.mktemp("kept")
    source = load.resolve_model(str(write_gguf(folder / "tiny-Q.gguf", quant=("Q4_0", "Q8_0", "Q5_1"))))
    cache = folder / "cache"
    return source, cache, load.load_tokenizer(source, cache)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_quantised_gguf_kept_computes_what_its_conversion_computes(quantised_gguf, dtype, monkeypatch):
    """The model read with its weights kept (Llama: query and key rows reordered; the output head
    tied to the embedding) gives the converted model's logits, bit for bit, in a quarter of its
    float32 memory; a later load shares the kept weights."""
    from prefixcache.model import keptload, load

    source, cache, tokenizer = quantised_gguf
    monkeypatch.setattr(keptload, "EXPAND_BELOW", 0)  # kept, however small
    fast = load.load_model(source, tokenizer, cache, "cpu", dtype)
    assert getattr(fast, "_prefixcache_kept", False)
    assert isinstance(fast.get_output_embeddings(), KeptLinear)
    assert fast.get_output_embeddings().kept is fast.get_input_embeddings().kept  # tied, held once
    real_load_kept = keptload.load_kept
    monkeypatch.setattr(keptload, "load_kept", lambda *a, **k: None)  # converted, as before
    converted = load.load_model(source, tokenizer, cache, "cpu", dtype)
    ids = torch.tensor([[1, 5, 9, 2, 7, 3, 11, 40]])
    with torch.inference_mode():
        assert torch.equal(fast(ids).logits, converted(ids).logits)
    dense = sum(p.numel() * 4 for p in converted.parameters())
    assert kept_bytes(fast) < dense * 0.4
    monkeypatch.setattr(keptload, "load_kept", real_load_kept)
    again = load.load_model(source, tokenizer, cache, "cpu", torch.float32)
    assert again.get_input_embeddings().kept is fast.get_input_embeddings().kept
    again.to("meta")  # a model moved off the CPU takes the kept weights it shares with it: a later load reads its own
    third = load.load_model(source, tokenizer, cache, "cpu", torch.float32)
    assert third.get_input_embeddings().kept.codes.device.type == "cpu"
    monkeypatch.undo()  # a small model: its weights expanded once as it loads, into plain layers
    small = load.load_model(source, tokenizer, cache, "cpu", dtype)
    assert type(small.get_output_embeddings()) is torch.nn.Linear and small.get_output_embeddings().weight is \
        small.get_input_embeddings().weight
    with torch.inference_mode():
        assert torch.equal(small(ids).logits, converted(ids).logits)


def test_an_architecture_whose_processing_is_more_than_reordering_rows_is_converted(quantised_gguf, monkeypatch):
    from prefixcache.model import keptload

    from prefixcache.model import load

    source, cache, tokenizer = quantised_gguf
    config = load.gguf_config(source, tokenizer, load.converted_dir(source, cache))
    assert keptload.load_kept(Path(source.path), config, torch.float32) is not None
    monkeypatch.setattr(keptload, "ROW_ORDER", ())
    assert keptload.load_kept(Path(source.path), config, torch.float32) is None
