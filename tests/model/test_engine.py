"""The core check: cached, batched scores equal a naive full forward per (item, candidate)."""

from __future__ import annotations

import pytest
import torch
from helpers import TEXTS, invoke, make_spec, naive_scores

from prefixcache.model.engine import Engine
from prefixcache.task.prompt import PromptBuilder
from prefixcache.model.reference import score_naive
from prefixcache.model.rows import Row

TOL = 1e-4


def _batched(engine, prefix, rows, batch_size):
    out = []
    for i in range(0, len(rows), batch_size):
        out += engine.score(prefix, rows[i: i + batch_size])
    return out


def _started(tmp_path, tokenizer, model, backend="auto"):
    """The test spec's prompt builder, an engine on `model` and the prefilled prefix."""
    builder = PromptBuilder(make_spec(tmp_path), tokenizer)
    engine = Engine(model, backend)
    return builder, engine, engine.prefill(builder.prefix_ids)


def _max_diff(a, b):
    return max(abs(x - y) for ra, rb in zip(a, b, strict=True) for x, y in zip(ra, rb, strict=True))


@pytest.fixture(scope="module")
def examples():
    return [
        {"text": "I was charged twice for my subscription.", "label": "billing"},
        {"text": "The app crashes when I open a project.", "label": "technical"},
    ]


BACKENDS = ("shared", "standard")


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("batch_size", [1, 3, 8])
def test_cached_batched_scores_equal_naive(arch_model, chat_tokenizer, tmp_path, examples, batch_size, backend):
    arch, model = arch_model
    builder = PromptBuilder(make_spec(tmp_path, examples=examples), chat_tokenizer)
    engine = Engine(model, backend)
    prefix = engine.prefill(builder.prefix_ids)
    cands = list(builder.candidates.values())
    assert any(len(c) > 2 for c in cands), "multi-token labels expected"
    encoded = [builder.encode_item({"text": t}) for t in TEXTS]
    assert len({len(e.ids) for e in encoded}) > 3, "items of different lengths expected"

    head_inputs = []  # a strided input makes matmul copy the head's weight once a row (rows x its size)
    hook = model.get_output_embeddings().register_forward_pre_hook(lambda m, a: head_inputs.append(a[0]))
    try:
        got = _batched(engine, prefix, [Row(e.ids, e.prefix_len, cands) for e in encoded], batch_size)
    finally:
        hook.remove()
    assert head_inputs and all(x.is_contiguous() for x in head_inputs)
    want = [naive_scores(model, e.ids, cands) for e in encoded]

    assert _max_diff(got, want) < TOL, arch
    assert engine.backend == backend  # no silent fallback
    # The check can fail: scores depend on the item by far more than the tolerance.
    assert max(abs(got[0][i] - got[1][i]) for i in range(len(cands))) > 100 * TOL


@pytest.mark.parametrize("backend", BACKENDS)
def test_rows_sharing_less_than_the_whole_prefix(arch_model, chat_tokenizer, tmp_path, backend):
    """Items whose first tokens merge with the prefix use only the cached ids they share."""
    _, model = arch_model
    builder, engine, prefix = _started(tmp_path, chat_tokenizer, model, backend)
    cands = list(builder.candidates.values())
    P = len(prefix.ids)
    encoded = [builder.encode_item({"text": t}) for t in TEXTS[:5]]
    rows = [Row(e.ids, max(e.prefix_len - k, 1), cands) for k, e in enumerate(encoded)]
    got = engine.score(prefix, rows)
    want = [score_naive(model, e.ids, cands) for e in encoded]
    assert _max_diff(got, want) < TOL
    assert all(r.prefix_len < P for r in rows[1:])


@pytest.mark.parametrize("backend", BACKENDS)
def test_rows_with_their_own_candidates(arch_model, chat_tokenizer, tmp_path, backend):
    """Different counts and lengths of candidates per row (multiple-choice style)."""
    _, model = arch_model
    builder, engine, prefix = _started(tmp_path, chat_tokenizer, model, backend)
    enc = lambda t: chat_tokenizer(t, add_special_tokens=False)["input_ids"]  # noqa: E731
    options = [
        [enc("two"), enc("four"), enc("six legs and a tail")],
        [enc("yes")],
        [enc("tech"), enc("technical"), enc("techn"), enc("a"), enc("account access please")],
    ]
    encoded = [builder.encode_item({"text": t}) for t in TEXTS[:3]]
    rows = [Row(e.ids, e.prefix_len, [tuple(o) for o in opts]) for e, opts in zip(encoded, options, strict=True)]
    got = engine.score(prefix, rows)
    want = [score_naive(model, e.ids, opts) for e, opts in zip(encoded, options, strict=True)]
    assert [len(g) for g in got] == [3, 1, 5]
    assert _max_diff(got, want) < TOL


@pytest.mark.parametrize("backend", BACKENDS)
def test_shared_prefix_is_never_mutated(chat_tokenizer, tmp_path, backend):
    from conftest import tiny_model

    model = tiny_model("llama", len(chat_tokenizer))
    builder, engine, prefix = _started(tmp_path, chat_tokenizer, model, backend)
    before = [(k.clone(), v.clone()) for k, v in prefix.kv]
    logits = prefix.last_logits.clone()
    cands = list(builder.candidates.values())
    rows = [Row(e.ids, e.prefix_len, cands) for e in (builder.encode_item({"text": t}) for t in TEXTS)]
    first = engine.score(prefix, rows)
    second = engine.score(prefix, rows)
    assert first == second
    for (k0, v0), (k1, v1) in zip(before, prefix.kv, strict=True):
        assert torch.equal(k0, k1) and torch.equal(v0, v1) and k1.shape[0] == 1
    assert torch.equal(logits, prefix.last_logits)


def test_prefix_last_logits_score_what_follows_it(chat_tokenizer, tmp_path):
    from conftest import tiny_model

    model = tiny_model("qwen2", len(chat_tokenizer))
    builder = PromptBuilder(make_spec(tmp_path), chat_tokenizer)
    prefix = Engine(model).prefill(builder.prefix_ids)
    full = model(input_ids=torch.tensor([list(builder.prefix_ids)])).logits[0, -1]
    assert torch.allclose(prefix.last_logits, full.float(), atol=TOL)


@pytest.mark.parametrize("backend", BACKENDS)
def test_plain_layout_equals_naive(plain_tokenizer, tmp_path, backend):
    from conftest import tiny_model

    model = tiny_model("llama", len(plain_tokenizer))
    builder = PromptBuilder(make_spec(tmp_path), plain_tokenizer)
    assert builder.mode == "plain"
    engine = Engine(model, backend)
    prefix = engine.prefill(builder.prefix_ids)
    cands = list(builder.candidates.values())
    encoded = [builder.encode_item({"text": t}) for t in TEXTS]
    got = _batched(engine, prefix, [Row(e.ids, e.prefix_len, cands) for e in encoded], 4)
    want = [score_naive(model, e.ids, cands) for e in encoded]
    assert _max_diff(got, want) < TOL


def _mistral(vocab):
    from transformers import MistralConfig, MistralForCausalLM

    torch.manual_seed(0)
    cfg = MistralConfig(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, initializer_range=0.2, sliding_window=None)
    return MistralForCausalLM(cfg).eval()


def test_unlisted_architecture_is_checked_once_then_shared(chat_tokenizer, tmp_path):
    model = _mistral(len(chat_tokenizer))
    builder = PromptBuilder(make_spec(tmp_path), chat_tokenizer)
    engine = Engine(model)
    assert engine.backend == "shared" and engine.unchecked
    prefix = engine.prefill(builder.prefix_ids)
    cands = list(builder.candidates.values())
    encoded = [builder.encode_item({"text": t}) for t in TEXTS[:4]]
    got = engine.score(prefix, [Row(e.ids, e.prefix_len, cands) for e in encoded])
    assert engine.backend == "shared" and not engine.unchecked
    assert _max_diff(got, [score_naive(model, e.ids, cands) for e in encoded]) < TOL


@pytest.fixture()
def kernel():
    """Swap the registered shared-prefix kernel for a test's own; the real one comes back after."""
    from transformers import AttentionInterface

    from prefixcache.model import attention

    yield lambda fn: AttentionInterface.register(attention.NAME, fn)
    AttentionInterface.register(attention.NAME, attention.shared_prefix_attention)


def test_a_shared_path_that_disagrees_falls_back(chat_tokenizer, tmp_path, kernel):
    from prefixcache.model import attention

    def off(*args, **kwargs):
        out, weights = attention.shared_prefix_attention(*args, **kwargs)
        return (out * 1.5 if attention.STATE_KW in kwargs else out), weights

    kernel(off)
    model = _mistral(len(chat_tokenizer))
    builder, engine, prefix = _started(tmp_path, chat_tokenizer, model)
    cands = list(builder.candidates.values())
    encoded = [builder.encode_item({"text": t}) for t in TEXTS[:4]]
    got = engine.score(prefix, [Row(e.ids, e.prefix_len, cands) for e in encoded])
    assert engine.backend == "standard"
    assert _max_diff(got, [score_naive(model, e.ids, cands) for e in encoded]) < TOL


def _raising(exc: Exception):
    """A kernel that raises `exc` in scoring forwards (and is plain SDPA elsewhere)."""
    from prefixcache.model import attention

    def kernel_fn(*args, **kwargs):
        if attention.STATE_KW in kwargs:
            raise exc
        return attention.shared_prefix_attention(*args, **kwargs)

    return kernel_fn


def _prefilled_llama(tokenizer, tmp_path):
    from conftest import tiny_model

    model = tiny_model("llama", len(tokenizer))
    builder = PromptBuilder(make_spec(tmp_path), tokenizer)
    engine = Engine(model)
    return model, builder, engine, engine.prefill(builder.prefix_ids)


@pytest.mark.parametrize("error", [AttributeError, TypeError, RuntimeError])
def test_a_bug_in_the_kernel_surfaces_instead_of_a_slow_path(chat_tokenizer, tmp_path, kernel, error):
    """Only UnsupportedAttention means "this model cannot use the shared kernel"; anything else
    raised there is a bug and must not quietly turn every later batch into the padded path."""
    kernel(_raising(error("a bug in the kernel")))
    model, builder, engine, prefix = _prefilled_llama(chat_tokenizer, tmp_path)
    enc = builder.encode_item({"text": TEXTS[0]})
    with pytest.raises(error, match="a bug in the kernel"):
        engine.score(prefix, [Row(enc.ids, enc.prefix_len, list(builder.candidates.values()))])
    assert engine.backend == "shared"


def test_unsupported_attention_falls_back_once_with_a_reason(chat_tokenizer, tmp_path, kernel, caplog):
    from prefixcache.model.attention import UnsupportedAttention

    kernel(_raising(UnsupportedAttention("needs something the kernel does not do")))
    model, builder, engine, prefix = _prefilled_llama(chat_tokenizer, tmp_path)
    cands = list(builder.candidates.values())
    encoded = [builder.encode_item({"text": t}) for t in TEXTS[:3]]
    got = engine.score(prefix, [Row(e.ids, e.prefix_len, cands) for e in encoded])
    assert engine.backend == "standard"
    assert caplog.text.count("needs something the kernel does not do") == 1
    assert _max_diff(got, [score_naive(model, e.ids, cands) for e in encoded]) < TOL


def test_a_kernel_bug_is_exit_1_through_the_cli(tmp_path, tiny_model_dir, kernel):
    import json

    from helpers import write_spec


    kernel(_raising(AttributeError("a bug in the kernel")))
    items = tmp_path / "in.jsonl"
    items.write_text(json.dumps({"id": 1, "text": "crash"}) + "\n")
    spec = write_spec(tmp_path, model=str(tiny_model_dir))
    result = invoke("run", str(spec), str(items), "--no-cache-store")
    assert result.exit_code == 1
    assert result.stderr.splitlines()[-1] == "internal error: AttributeError: a bug in the kernel (run with --debug for a traceback)"
    debug = invoke("run", str(spec), str(items), "--no-cache-store", "--debug")
    assert debug.exit_code == 1 and "Traceback" in debug.stderr and "in kernel_fn" in debug.stderr
