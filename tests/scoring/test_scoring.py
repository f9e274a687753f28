"""Normalisation, calibration and the decision rule, against direct computation."""

from __future__ import annotations

import math

import pytest

from prefixcache.task.decision import calibrate, decide, mean_distribution, normalise, softmax

LOGPROBS = [-2.0, -6.0, -3.5]
TOKENS = [1, 4, 2]
TEXTS = ["yes", "not at all", "née"]  # "née" has 3 characters and 4 UTF-8 bytes
UNCOND = [-1.0, -7.0, -2.0]


def test_each_normalisation_is_the_direct_computation():
    assert normalise(LOGPROBS, "sum") == LOGPROBS
    assert normalise(LOGPROBS, "mean", TOKENS) == [-2.0, -1.5, -1.75]
    assert normalise(LOGPROBS, "chars", texts=TEXTS) == [-2.0 / 3, -6.0 / 10, -3.5 / 3]
    assert normalise(LOGPROBS, "bytes", texts=TEXTS) == [-2.0 / 3, -6.0 / 10, -3.5 / 4]
    assert normalise(LOGPROBS, "pmi", unconditional=UNCOND) == [-1.0, 1.0, -1.5]
    with pytest.raises(ValueError):
        normalise(LOGPROBS, "max")


def test_softmax():
    probs = softmax([0.0, math.log(3.0)])
    assert probs == pytest.approx([0.25, 0.75])
    assert softmax([1000.0, 1000.0]) == [0.5, 0.5]  # no overflow


def test_calibration_recovers_a_known_prior():
    """A model whose outputs are the true distribution times a known label bias: dividing by the
    bias measured on content-free inputs gives back the true distribution."""
    prior = [0.7, 0.2, 0.1]  # what the prompt alone makes the model prefer
    truths = [[0.2, 0.5, 0.3], [0.6, 0.3, 0.1], [1 / 3, 1 / 3, 1 / 3]]
    for truth in truths:
        biased = [t * p for t, p in zip(truth, prior, strict=True)]
        biased = [b / sum(biased) for b in biased]
        assert calibrate(biased, prior) == pytest.approx(truth)
    # Content-free inputs carry no information: their distribution is the prior itself.
    assert mean_distribution([[0.6, 0.3, 0.1], [0.8, 0.1, 0.1]]) == pytest.approx(prior)


def test_decide_threshold_margin_and_ties():
    assert decide([0.2, 0.5, 0.3]) == (1, pytest.approx(0.2))
    assert decide([0.2, 0.5, 0.3], threshold=0.6) == (None, pytest.approx(0.2))
    assert decide([0.5, 0.5]) == (0, 0.0)  # ties go to the first
    assert decide([1.0]) == (0, 1.0)
