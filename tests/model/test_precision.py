"""Each precision's entry: the shared, batched path against a naive forward in the same precision
within the tolerance its entry states; and what the rest of the program reads of the registry."""

from __future__ import annotations

import json

import pytest
from conftest import tiny_model
from helpers import TEXTS, invoke, make_spec, write_spec

from prefixcache.errors import UsageError
from prefixcache.model import precision as registry
from prefixcache.model.engine import Engine
from prefixcache.model.reference import score_naive
from prefixcache.model.rows import Row
from prefixcache.task.prompt import PromptBuilder


def _in_precision(entry, vocab):
    import torch

    model = tiny_model("llama", vocab).to(getattr(torch, entry.loads_as))
    if entry.quantise is not None:
        if not entry.installed():
            pytest.skip(f"{entry.name} needs {entry.install}")
        entry.quantise(model)
    return model


@pytest.mark.parametrize("name", registry.names())
def test_each_precision_s_shared_path_equals_a_naive_forward_in_it_within_its_tolerance(name, chat_tokenizer, tmp_path):
    entry = registry.precision_named(name)
    model = _in_precision(entry, len(chat_tokenizer))
    builder = PromptBuilder(make_spec(tmp_path), chat_tokenizer)
    engine = Engine(model, "shared")
    assert engine.precision == name
    prefix = engine.prefill(builder.prefix_ids)
    cands = list(builder.candidates.values())
    encoded = [builder.encode_item({"text": t}) for t in TEXTS[:6]]
    got = engine.score(prefix, [Row(e.ids, e.prefix_len, cands) for e in encoded])
    want = [score_naive(model, e.ids, cands) for e in encoded]
    over = max(abs(x - y) - entry.tolerance - entry.relative * abs(y)
               for a, b in zip(got, want, strict=True) for x, y in zip(a, b, strict=True))
    assert over <= 0, (name, over)
    spread = max(abs(got[0][i] - got[1][i]) for i in range(len(cands)))
    assert spread > 3 * entry.tolerance  # the check can fail: items differ by far more than the tolerance


def test_the_registry_says_what_each_precision_is():
    assert registry.names()[0] == "float32" and set(registry.low_names()) == {"bfloat16", "float16", "int8"}
    assert registry.precision_named("int8").loads_as == "float32"  # loaded, then quantised
    assert registry.precision_named("int8").packages == ("torchao",)
    assert not registry.precision_named("float32").moves_with_batch
    assert all(registry.precision_named(n).moves_with_batch for n in registry.low_names())
    with pytest.raises(UsageError, match=r"unknown dtype 'int4'; use auto, float32, bfloat16, float16 or int8"):
        registry.precision_named("int4")


def test_a_bfloat16_output_says_its_scores_move_with_the_batch(tmp_path, tiny_model_dir):
    """bfloat16 scores move with the items batched beside them (measured: up to 0.04 nats on the
    tiny model), so an output keeps the batch options that reproduce it."""
    spec = write_spec(tmp_path, model=str(tiny_model_dir))
    items = tmp_path / "in.jsonl"
    items.write_text("".join(json.dumps({"id": n, "text": t}) + "\n" for n, t in enumerate(TEXTS)))
    for dtype in ("bfloat16", "float32"):
        out = tmp_path / f"{dtype}.jsonl"
        assert invoke("run", spec, items, "-o", out, "--dtype", dtype, "-q").exit_code == 0
        fingerprint = json.loads((tmp_path / f"{dtype}.jsonl.prefixcache.json").read_text())
        assert fingerprint["scores_move_with_batch"] is (dtype == "bfloat16")
