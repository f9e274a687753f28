"""Each private or unstable torch/transformers touchpoint listed in prefixcache.compat, checked on
its own, so an upgrade that breaks one fails here with its name rather than somewhere deep in a
scoring test (or, worse, as a silent slow path)."""

from __future__ import annotations

import pytest
import torch
from conftest import tiny_model

from prefixcache.model import attention

from prefixcache import compat


@pytest.fixture(scope="module")
def llama(chat_tokenizer):
    return tiny_model("llama", len(chat_tokenizer))


def test_cpu_flash_attention_op_returns_output_and_log_sum_exp():
    op = compat.flash_attention_cpu()
    assert op is not None, "torch.ops.aten._scaled_dot_product_flash_attention_for_cpu is gone"
    torch.manual_seed(0)
    q, k, v = torch.randn(2, 4, 5, 8), torch.randn(2, 4, 7, 8), torch.randn(2, 4, 7, 8)
    mask = torch.zeros(2, 1, 5, 7)
    mask[..., -2:] = float("-inf")
    out, lse = op(q, k, v, 0.0, False, attn_mask=mask, scale=0.5)[:2]
    scores = q @ k.transpose(-1, -2) * 0.5 + mask
    assert torch.allclose(lse, torch.logsumexp(scores, -1), atol=1e-5), "flash op: log-sum-exp changed meaning"
    assert torch.allclose(out, torch.softmax(scores, -1) @ v, atol=1e-5), "flash op: output changed meaning"


def test_transformers_sdpa_function_matches_torch_sdpa(llama):
    forward = compat.sdpa_forward()
    module = llama.model.layers[0].self_attn
    torch.manual_seed(0)
    q, k, v = torch.randn(1, 4, 6, 16), torch.randn(1, 2, 6, 16), torch.randn(1, 2, 6, 16)
    out, _ = forward(module, q, k, v, None, scaling=0.25, is_causal=True)
    want = torch.nn.functional.scaled_dot_product_attention(
        q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1), is_causal=True, scale=0.25)
    assert torch.allclose(out, want.transpose(1, 2), atol=1e-5), "sdpa_attention_forward: output layout changed"


def test_attention_switch_reaches_the_registered_kernel_and_is_restored(llama, monkeypatch):
    assert compat.can_set_attention(llama), "PreTrainedModel._can_set_attn_implementation() no longer says True"
    calls = []
    original = attention.shared_prefix_attention

    def counting(*args, **kwargs):
        calls.append(1)
        return original(*args, **kwargs)

    from transformers import AttentionInterface

    AttentionInterface.register(attention.NAME, counting)
    try:
        before = llama.config._attn_implementation
        with compat.attention_implementation(llama.config, attention.NAME):
            llama(input_ids=torch.tensor([[1, 2, 3]]), use_cache=False)
        assert llama.config._attn_implementation == before, "config._attn_implementation was not restored"
    finally:
        AttentionInterface.register(attention.NAME, original)
    assert len(calls) == llama.config.num_hidden_layers, "setting config._attn_implementation no longer switches attention"


def test_hub_revision_is_read_from_the_hub_cache_layout(tmp_path):
    commit = "0123456789abcdef0123456789abcdef01234567"
    repo = tmp_path / "models--org--name"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(commit)
    (repo / "snapshots" / commit).mkdir(parents=True)
    (repo / "snapshots" / commit / "config.json").write_text("{}")
    assert compat.hub_revision("org/name", cache_dir=str(tmp_path)) == commit, \
        "huggingface_hub's cache layout (refs/main, snapshots/<commit>/) changed"
    assert compat.hub_revision("org/other", cache_dir=str(tmp_path)) is None


def test_cache_kwarg_and_cache_round_trip(llama):
    name = compat.cache_kwarg(llama)
    assert name in ("cache", "past_key_values")
    out = llama(input_ids=torch.tensor([[5, 6, 7, 8]]), use_cache=True, **{name: compat.cache_from(())})
    kv = compat.cache_layers(compat.returned_cache(out))
    assert len(kv) == llama.config.num_hidden_layers, "the returned cache no longer has .layers[i].keys/.values"
    assert all(k.shape[-2] == 4 and v.shape[-2] == 4 for k, v in kv)
    again = compat.cache_layers(compat.cache_from(kv))
    assert all(torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]) for a, b in zip(kv, again, strict=True)), \
        "DynamicCache(list of (keys, values)) no longer holds what it is given"


def test_gguf_progress_bar_is_switched_off_and_restored():
    from transformers import modeling_gguf_pytorch_utils as gguf_utils

    original = getattr(gguf_utils, "tqdm", None)
    assert original is not None, "modeling_gguf_pytorch_utils.tqdm is gone: the GGUF bar cannot be silenced"
    with compat.gguf_progress_bar(False):
        assert gguf_utils.tqdm([1], file=None).disable, "the GGUF conversion bar is not disabled"
    assert gguf_utils.tqdm is original


def test_the_fast_gguf_reader_reads_what_ggufs_own_reader_reads(gguf_file):
    """Every field (its parts, types and value indices) and every tensor (name, type, shape and
    bytes) as gguf's reader gives them, with tensors still views of the mapped file."""
    import gguf
    import numpy as np
    want, got = gguf.GGUFReader(gguf_file), compat.gguf_reader(gguf_file)
    assert list(got.fields) == list(want.fields) and len(want.fields["tokenizer.ggml.tokens"].data) > 1000
    for name, field in want.fields.items():
        mine = got.fields[name]
        assert (mine.types, mine.data, mine.offset) == (field.types, field.data, field.offset), name
        assert len(mine.parts) == len(field.parts) and all(np.array_equal(a, b) for a, b in zip(mine.parts, field.parts, strict=True))
    assert [(t.name, t.tensor_type, list(t.shape)) for t in got.tensors] == \
        [(t.name, t.tensor_type, list(t.shape)) for t in want.tensors]
    assert all(np.array_equal(a.data, b.data) for a, b in zip(got.tensors, want.tensors, strict=True))
    assert isinstance(got.tensors[0].data.base, np.memmap) or isinstance(got.tensors[0].data.base.base, np.memmap)


def test_drop_quantizer_saves_plain_float_weights(llama, tmp_path):
    import json

    from transformers import AutoModelForCausalLM

    llama.config.quantization_config = {"quant_method": "gguf"}
    compat.drop_quantizer(llama)
    llama.save_pretrained(tmp_path)
    assert "quantization_config" not in json.loads((tmp_path / "config.json").read_text())
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path)
    assert getattr(loaded, "hf_quantizer", None) is None and loaded.dtype == torch.float32


def test_quiet_libraries_sets_verbosity_and_progress_bars():
    from transformers.utils import logging

    level, bars = logging.get_verbosity(), logging.is_progress_bar_enabled()
    try:
        compat.quiet_libraries()
        assert logging.get_verbosity() == logging.ERROR and not compat.progress_bars_enabled()
    finally:
        logging.set_verbosity(level)
        if bars:
            logging.enable_progress_bar()


def test_typer_usage_errors_are_the_classes_it_raises():
    import typer

    usage_error, no_args = compat.cli_usage_errors()
    assert issubclass(typer.BadParameter, usage_error) and issubclass(no_args, usage_error), \
        "typer no longer raises usage errors of typer._click.exceptions.UsageError"


@pytest.mark.parametrize("arch", ("llama", "gpt2"))
def test_decoder_layers_and_layer_states_read_each_layers_output(arch, chat_tokenizer):
    """base_model.layers / .h, a decoder layer's output (a tensor or a tuple) and the base model's
    last_hidden_state: what `compat.layer_states` reads are output_hidden_states' own values."""
    model = llama_or(arch, chat_tokenizer)
    layers = compat.decoder_layers(model)
    assert len(layers) == model.config.get_text_config().num_hidden_layers
    seen, ids = {}, torch.tensor([[5, 6, 7, 8, 9]])
    with compat.layer_states(model, [None, 1, len(layers) - 1], seen), torch.no_grad():
        out = model(input_ids=ids, output_hidden_states=True)
    head = []
    hook = model.get_output_embeddings().register_forward_pre_hook(lambda m, a: head.append(a[0]))
    with torch.no_grad():
        model(input_ids=ids)
    hook.remove()
    assert torch.allclose(seen[None], head[0], atol=1e-6), "last_hidden_state is no longer what the lm_head reads"
    for i in (1, len(layers) - 1):
        assert torch.allclose(seen[i], out.hidden_states[i], atol=1e-6), f"decoder layer {i}'s output moved"
    with pytest.raises(compat.NoLayers):
        compat.decoder_layers(_Bare())


class _Bare(torch.nn.Module):
    """A model with no decoder layers where prefixcache looks for them."""

    @property
    def base_model(self):
        return torch.nn.Module()


def llama_or(arch, tokenizer):
    return tiny_model(arch, len(tokenizer))


def test_chat_templates_are_compiled_in_the_environment_given():
    """touchpoint: chat_template_utils.ImmutableSandboxedEnvironment, _compile_jinja_template."""
    from transformers.utils import chat_template_utils as templates

    from prefixcache.model.template import BoundedEnvironment

    compat.chat_template_environment(BoundedEnvironment)
    compiled = templates._compile_jinja_template("{{ messages[0]['content'] }}")
    assert isinstance(compiled.environment, BoundedEnvironment)
    assert templates.render_jinja_template([[{"role": "user", "content": "hi"}]],
                                           chat_template="{{ messages[0]['content'] }}")[0][0] == "hi"
