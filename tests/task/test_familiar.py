"""A head's fitted rows in brief (task/familiar.py): how far a new item lies from them."""

from __future__ import annotations

import json

import numpy as np
import pytest

from prefixcache.errors import SpecError
from prefixcache.task.familiar import Familiar, summarise
from prefixcache.task.head import Readout, head_bytes, load_head

FP = {"model": "m" * 32, "prefix": "p" * 32, "template": "t" * 32, "questions": "q" * 32}


def _states(rng, n, shift=0.0, basis=None):
    """Rows of a low-rank process in 48 dimensions (8 directions and a little noise)."""
    basis = rng.normal(size=(8, 48)) if basis is None else basis
    return rng.normal(size=(n, 8)) @ basis + 0.3 * rng.normal(size=(n, 48)) + shift, basis


def _auroc(inside, outside):
    return float(np.mean([[o > i for i in inside] for o in outside]))


def test_held_out_rows_rarely_lie_beyond_the_cut_and_other_rows_mostly_do():
    rng = np.random.default_rng(0)
    fitted, basis = _states(rng, 300)
    familiar = summarise(fitted)
    same = [familiar.novelty(row) for row in _states(rng, 400, basis=basis)[0]]
    other = [familiar.novelty(row) for row in _states(rng, 400)[0]]  # another process: other directions
    moved = [familiar.novelty(row) for row in _states(rng, 400, shift=3.0, basis=basis)[0]]
    assert np.mean(np.array(same) > 1) < 0.04  # the cut is what 99% of held-out rows reach
    assert np.mean(np.array(other) > 1) > 0.9 and _auroc(same, other) > 0.99
    assert np.mean(np.array(moved) > 1) > 0.5 and _auroc(same, moved) > 0.9


def test_a_head_keeps_its_rows_in_brief_and_reads_them_back(tmp_path):
    rng = np.random.default_rng(1)
    states, _ = _states(rng, 60)
    familiar = summarise(states)
    readout = Readout("label", ("a", "b"), False, "state", states.mean(0)[None], states.std(0)[None],
                      rng.normal(size=(2, 48)), np.zeros(2), familiar=familiar)
    path = tmp_path / "head.safetensors"
    path.write_bytes(head_bytes([readout], FP, "final", {}))
    spec = tmp_path / "spec.yaml"
    back = load_head(path.name, spec).readouts[0]
    assert back.familiar is not None and back.familiar.basis.shape == familiar.basis.shape
    row = states[0]
    assert back.novelty({"state": row[None]}) == pytest.approx(readout.novelty({"state": row[None]}), rel=1e-4)
    plain = Readout("label", ("a", "b"), False, "state", readout.mean, readout.scale, readout.coef, readout.intercept)
    path.write_bytes(head_bytes([plain], FP, "final", {}))
    assert load_head(path.name, spec).readouts[0].novelty({"state": row[None]}) is None  # a head without them


@pytest.mark.parametrize("said, words", [({"residual": 1.0}, "familiarity header is malformed"),
                                         ({"residual": 1.0, "cut": -1.0}, "familiarity scales are not positive")])
def test_a_familiarity_header_that_is_not_one_is_refused(tmp_path, said, words):
    from safetensors.numpy import load, save

    rng = np.random.default_rng(2)
    states, _ = _states(rng, 40)
    readout = Readout("label", ("a", "b"), False, "state", np.zeros((1, 48)), np.ones((1, 48)),
                      rng.normal(size=(2, 48)), np.zeros(2), familiar=summarise(states))
    data = head_bytes([readout], FP, "final", {})
    from prefixcache.task.head import META_KEY, metadata_of

    meta = json.loads(metadata_of(data)[META_KEY])
    meta["questions"][0]["familiar"] = said
    (tmp_path / "h.safetensors").write_bytes(save(load(data), metadata={META_KEY: json.dumps(meta)}))
    with pytest.raises(SpecError, match=words):
        load_head("h.safetensors", tmp_path / "spec.yaml")


def test_a_summary_with_too_few_rows_still_scores():
    familiar = summarise(np.arange(12.0).reshape(3, 4))
    assert isinstance(familiar, Familiar) and np.isfinite(familiar.novelty(np.ones(4)))


def test_reliability_is_monotone_smoothed_and_read_back(tmp_path):
    from prefixcache.task.reliability import PRIOR, Reliability, fitted_reliability

    rng = np.random.default_rng(5)
    confidence = rng.uniform(0.3, 1.0, 400)
    right = rng.random(400) < confidence - 0.2  # answers claiming 0.2 more than they are worth
    found = fitted_reliability(confidence, right)
    assert found is not None and list(found.upto) == sorted(found.upto)
    assert found.at(0.9) == pytest.approx(0.7, abs=0.1) and found.at(0.5) == pytest.approx(0.3, abs=0.1)
    few = fitted_reliability([0.6, 0.9, 0.95], [False, True, True])  # two right rows never say "always right"
    assert few is not None and few.at(0.99) == pytest.approx((2 + PRIOR * 2 / 3) / (2 + PRIOR))
    assert few.at(0.5) == pytest.approx((0 + PRIOR * 2 / 3) / (1 + PRIOR))
    assert fitted_reliability([0.6, 0.9], [True, False]).at(0.9) == pytest.approx(0.5)  # pooled: not monotone
    assert Reliability.from_json(found.to_json()).at(0.8) == pytest.approx(found.at(0.8), abs=1e-6)
    assert Reliability.from_json({"upto": [0.5, 0.2], "right": [0.1, 0.2]}) is None
    readout = Readout("label", ("a", "b"), False, "state", np.zeros((1, 48)), np.ones((1, 48)),
                      rng.normal(size=(2, 48)), np.zeros(2), reliability=found)
    (tmp_path / "h.safetensors").write_bytes(head_bytes([readout], FP, "final", {}))
    back = load_head("h.safetensors", tmp_path / "spec.yaml").readouts[0]
    assert back.reliability is not None and back.reliability.at(0.77) == pytest.approx(found.at(0.77), abs=1e-6)
