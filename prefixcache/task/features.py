"""What a fitted head reads of the model's forward (`Features`): named views of the same pass,
joined in order, and optionally the options' prompt log-probabilities. No torch here.

A view is `state` (the state at the question's answer position, where its first option token is
scored) or `mean` (the mean over the item's own tokens: its prompt after the shared prefix), each
of the final layer (after the last norm: what the lm_head reads) or, with `@i`, of the residual
stream after decoder layer i. A feature set is views joined by `+`, with `logprobs` last where the
options' log-probabilities are read too:

    state                   the final state at the answer position (what every engine gives)
    state+logprobs          ... and the options' log-probabilities (the options are then scored)
    state+mean              ... and the final layer's mean over the item's tokens
    state@15+mean@15        layer 15's state at the answer position and its mean

A head reads only what its engine can give (`Engine.layers`: 0 for the final state alone).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Mapping, Sequence

import numpy as np

_VIEW = re.compile(r"(state|mean)(?:@([1-9][0-9]{0,3}))?")
LOGPROBS = "logprobs"


@dataclass(frozen=True)
class Features:
    """A parsed feature set: its views in order and whether it reads the options' log-probs."""

    views: tuple[str, ...]
    logprobs: bool = False

    @classmethod
    def parse(cls, text: str) -> "Features":
        """Raises ValueError for anything not a feature set (see the module's docstring)."""
        parts = text.split("+") if isinstance(text, str) else []
        logprobs = bool(parts) and parts[-1] == LOGPROBS
        views = tuple(parts[:-1] if logprobs else parts)
        if not views or len(set(views)) != len(views) or not all(_VIEW.fullmatch(v) for v in views):
            raise ValueError(f"{text!r} is not a feature set (views such as state, mean, state@12, joined by '+')")
        return cls(views, logprobs)

    @property
    def name(self) -> str:
        return "+".join(self.views + ((LOGPROBS,) if self.logprobs else ()))

    @property
    def layers(self) -> tuple[int | None, ...]:
        """The layers read, each once, the final one (None) first."""
        found = {layer_of(v) for v in self.views}
        return tuple(sorted(found, key=lambda x: -1 if x is None else x))

    @property
    def mean(self) -> bool:
        return any(v.startswith("mean") for v in self.views)

    @property
    def deepest(self) -> int:
        """The deepest decoder layer it reads (0: the final state only)."""
        return max((x for x in self.layers if x is not None), default=0)

    @property
    def beyond_final(self) -> bool:
        """It reads more than the final state at answer positions (an engine with layers must give it)."""
        return self.mean or self.deepest > 0

    @property
    def plain(self) -> bool:
        """The final state at the answer position alone (with or without the log-probs)."""
        return self.views == ("state",)

    def joined(self, views: Mapping[str, np.ndarray]) -> np.ndarray:
        """The views read, side by side: [..., len(views) * H]."""
        return np.concatenate([np.asarray(views[v]) for v in self.views], axis=-1)


def layer_of(view: str) -> int | None:
    """The layer a view reads (None: the final state)."""
    _, _, layer = view.partition("@")
    return int(layer) if layer else None


def views_of(feature_sets: Sequence[Features]) -> tuple[str, ...]:
    """Every view the feature sets read, each once, in a fixed order."""
    return tuple(sorted({v for f in feature_sets for v in f.views}, key=lambda v: (layer_of(v) or 0, v)))


def candidates(layers: int, logprobs: bool = False) -> tuple[Features, ...]:
    """The feature sets `fit` tries on a model whose engine reads `layers` decoder layers (0: the
    final state alone): the final state; with its mean over the item's tokens; the middle layer's
    state and mean (a middle layer often separates topics better than the last, which is shaped
    for the next token); and with `logprobs`, the final state with the options' log-probs."""
    out = [Features(("state",))]
    if layers:
        middle = max(1, round(layers / 2))
        out += [Features(("state", "mean")), Features((f"state@{middle}", f"mean@{middle}"))]
    if logprobs:
        out.append(Features(("state",), True))
    return tuple(out)
