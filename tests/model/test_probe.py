"""A probe's states (a middle layer's and the mean over an item's own tokens) equal the same
quantities of one plain full forward of the item's prompt, on every architecture the tests cover
and both attention paths; reading them changes no score."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from helpers import TEXTS, make_spec
from prefixcache import compat
from prefixcache.model.engine import Engine
from prefixcache.model.rows import Probe, Row
from prefixcache.task.prompt import PromptBuilder


def _plain(model, ids, layer):
    """Every position's state of one plain forward: the final normed one (layer None), or the
    residual stream after decoder layer `layer`, [T, H]."""
    with torch.no_grad():
        out = model(input_ids=torch.tensor([list(ids)]), output_hidden_states=True)
    if layer is None:
        seen = {}
        with compat.layer_states(model, [None], seen), torch.no_grad():
            model(input_ids=torch.tensor([list(ids)]))
        return seen[None][0]
    return out.hidden_states[layer][0]


@pytest.mark.parametrize("backend", ("shared", "standard"))
def test_a_probe_reads_what_one_full_forward_computes(arch_model, chat_tokenizer, tmp_path, backend):
    arch, model = arch_model
    builder = PromptBuilder(make_spec(tmp_path), chat_tokenizer)
    engine = Engine(model, backend)
    assert engine.layers == model.config.get_text_config().num_hidden_layers
    prefix = engine.prefill(builder.prefix_ids)
    cands = list(builder.candidates.values())
    encoded = [builder.encode_item({"text": t}) for t in TEXTS[:5]]
    rows = [Row(e.ids, e.prefix_len, cands) for e in encoded]
    middle = max(1, engine.layers // 2)
    probe = Probe((None, middle), mean=True)
    plain_scores, plain_states = engine.score_with_states(prefix, rows, [[0]] * len(rows))
    scores, probed = engine.score_with_states(prefix, rows, [[0]] * len(rows), probe)
    assert scores == plain_scores
    for e, found, final in zip(encoded, probed, plain_states, strict=True):
        assert found.shape == (2, 2, model.config.get_text_config().hidden_size)
        assert np.abs(found[0, 0] - final[0]).max() < 1e-5  # the final state at the answer: what the head read before
        for n, layer in enumerate(probe.layers):
            every = _plain(model, e.ids, layer).numpy()  # [T, H]
            assert np.abs(found[0, n] - every[-1]).max() < 1e-5, (arch, layer)
            assert np.abs(found[1, n] - every[e.prefix_len:].mean(axis=0)).max() < 1e-5, (arch, layer)
