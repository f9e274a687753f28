"""Architectures beyond the core three: sliding-window attention (all layers or some), attention
softcapping, layers that do not pass attention arguments through, and a model that cannot be
scored from a cached prefix at all. Each is compared with a full forward per (item, candidate)."""

from __future__ import annotations

import pytest
import torch
import transformers
from helpers import TEXTS, invoke, make_spec

from prefixcache.model.engine import Engine
from prefixcache.errors import ModelError
from prefixcache.task.prompt import PromptBuilder
from prefixcache.model.reference import score_naive
from prefixcache.model.rows import Row

TOL = 1e-4
WINDOW = 16  # far shorter than the test prompts (~70-110 tokens), so the window always binds


def _model(config_class: str, vocab: int, attn: str = "sdpa", **extra):
    torch.manual_seed(0)
    common = dict(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, initializer_range=0.2, max_position_embeddings=1024,
                  tie_word_embeddings=False, pad_token_id=0, bos_token_id=0, eos_token_id=0)
    config = getattr(transformers, config_class)(**{**common, **extra})
    return transformers.AutoModelForCausalLM.from_config(config, attn_implementation=attn).float().eval()


WINDOWED = {
    # every layer slides
    "mistral": dict(config_class="MistralConfig", sliding_window=WINDOW),
    # layer 0 full, layer 1 sliding: one mask per layer type
    "qwen2": dict(config_class="Qwen2Config", use_sliding_window=True, sliding_window=WINDOW, max_window_layers=1),
    "gemma3": dict(config_class="Gemma3TextConfig", head_dim=16, sliding_window=WINDOW,
                   layer_types=["sliding_attention", "full_attention"]),
    # softcapped attention: the padded path, with sliding and full layers
    "gemma2": dict(config_class="Gemma2Config", attn="eager", head_dim=16, sliding_window=WINDOW),
}


def _score(chat_tokenizer, tmp_path, model, backend):
    builder = PromptBuilder(make_spec(tmp_path), chat_tokenizer)
    engine = Engine(model, backend)
    prefix = engine.prefill(builder.prefix_ids)
    cands = list(builder.candidates.values())
    encoded = [builder.encode_item({"text": t}) for t in TEXTS]
    assert min(len(e.ids) for e in encoded) > 2 * WINDOW
    got = []
    for i in range(0, len(encoded), 4):
        got += engine.score(prefix, [Row(e.ids, e.prefix_len, cands) for e in encoded[i: i + 4]])
    want = [score_naive(model, e.ids, cands) for e in encoded]
    return engine, got, want


def _max_diff(a, b):
    return max(abs(x - y) for ra, rb in zip(a, b, strict=True) for x, y in zip(ra, rb, strict=True))


@pytest.mark.parametrize("backend", ["auto", "standard"])
@pytest.mark.parametrize("name", list(WINDOWED))
def test_sliding_window_models_equal_naive(chat_tokenizer, tmp_path, name, backend):
    model = _model(vocab=len(chat_tokenizer), **WINDOWED[name])
    engine, got, want = _score(chat_tokenizer, tmp_path, model, backend)
    assert _max_diff(got, want) < TOL
    expected = "standard" if name == "gemma2" or backend == "standard" else "shared"
    assert engine.backend == expected


def test_the_prefix_cache_keeps_every_position_of_sliding_layers(chat_tokenizer, tmp_path):
    model = _model(vocab=len(chat_tokenizer), **WINDOWED["mistral"])
    builder = PromptBuilder(make_spec(tmp_path), chat_tokenizer)
    prefix = Engine(model).prefill(builder.prefix_ids)
    assert len(prefix.ids) > WINDOW
    assert all(k.shape[2] == v.shape[2] == len(prefix.ids) for k, v in prefix.kv)


def test_layers_that_drop_attention_kwargs_fall_back(chat_tokenizer, tmp_path, caplog):
    # StableLM's decoder layers do not pass extra kwargs to their attention: the shared kernel
    # would never see the prefix. The engine notices and uses the padded path.
    model = _model("StableLmConfig", len(chat_tokenizer))
    engine, got, want = _score(chat_tokenizer, tmp_path, model, "auto")
    assert engine.backend == "standard"
    assert "do not pass attention arguments through" in caplog.text
    assert _max_diff(got, want) < TOL


def test_a_model_that_cannot_take_a_cached_prefix_is_a_model_error(chat_tokenizer, tmp_path):
    torch.manual_seed(0)
    config = transformers.BloomConfig(vocab_size=len(chat_tokenizer), hidden_size=64, n_layer=2, n_head=4)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager").eval()
    builder = PromptBuilder(make_spec(tmp_path), chat_tokenizer)
    engine = Engine(model)
    prefix = engine.prefill(builder.prefix_ids)
    encoded = builder.encode_item({"text": TEXTS[0]})
    with pytest.raises(ModelError, match="^bloom models are not supported"):
        engine.score(prefix, [Row(encoded.ids, encoded.prefix_len, list(builder.candidates.values()))])


def test_run_a_model_folder_without_sdpa_support(chat_tokenizer, tmp_path):
    """Gemma 2 refuses SDPA at load time: it is loaded with its own eager attention and runs."""
    import json

    from helpers import write_spec


    folder = tmp_path / "gemma2"
    _model(vocab=len(chat_tokenizer), **WINDOWED["gemma2"]).save_pretrained(folder)
    chat_tokenizer.save_pretrained(folder)
    items = tmp_path / "items.jsonl"
    items.write_text("".join(json.dumps({"id": n, "text": t}) + "\n" for n, t in enumerate(TEXTS)))
    out = tmp_path / "out.jsonl"
    result = invoke("run", str(write_spec(tmp_path, model=str(folder))), str(items), "-o", str(out))
    assert result.exit_code == 0, result.output
    assert [json.loads(line)["id"] for line in out.read_text().splitlines()] == list(range(len(TEXTS)))


def test_a_model_with_recurrent_layers_is_a_model_error(chat_tokenizer, tmp_path):
    # LFM2's convolution layers keep a state of their own kind, not keys and values.
    model = _model("Lfm2Config", len(chat_tokenizer), layer_types=["conv", "full_attention"])
    builder = PromptBuilder(make_spec(tmp_path), chat_tokenizer)
    with pytest.raises(ModelError, match="^lfm2 models are not supported: prefilling"):
        Engine(model).prefill(builder.prefix_ids)
