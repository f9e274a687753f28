"""One question's labelled data for `fit`: per item its states, its options' prompt
log-probabilities, its gold option(s) and what the prompt rule decided (`Labelled`), and what a
readout's inner cross-validation chose (`Choice`). No torch here.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np


@dataclass
class Labelled:
    """One question's labelled items. Multiclass: `gold` [N] option index, `prompt` [N, K] the
    prompt rule's distribution, `said` [N] its answer (-1: abstained). Binary (tags): `gold`
    [N, K] bool, `prompt` [N, K] P(on), `said` [N, K] bool."""

    qid: str
    options: tuple[str, ...]
    binary: bool
    states: dict[str, np.ndarray]  # per view (task/features.py): [N, U, H]
    logprobs: np.ndarray  # [N, K] (NaN where the options were not scored)
    gold: np.ndarray
    prompt: np.ndarray
    said: np.ndarray
    threshold: float | None = None  # multiclass: the spec's, below which an answer abstains (-1)
    prompted: np.ndarray | None = None  # [N] bool: the items whose options were scored (None: all)
    groups: np.ndarray | None = None  # [N] the digest of each item's text: copies share a fold (None: all distinct)
    notes: tuple[str, ...] = ()  # what the reading of the items found to say (near-copies)
    ids: tuple[str, ...] = ()  # each item's id, as text (to name items in notes)
    texts: tuple[str, ...] = ()  # each item's text as the template reads it (for the TF-IDF baseline)
    picked: np.ndarray | None = None  # [N] bool: chosen by `suggest` (not at random); None: all at random

    def subset(self, idx: np.ndarray) -> "Labelled":
        """The items `idx` alone."""
        return replace(self, states={v: a[idx] for v, a in self.states.items()}, logprobs=self.logprobs[idx],
                       ids=tuple(self.ids[i] for i in idx) if self.ids else (),
                       texts=tuple(self.texts[i] for i in idx) if self.texts else (),
                       picked=None if self.picked is None else self.picked[idx],
                       gold=self.gold[idx], prompt=self.prompt[idx], said=self.said[idx], prompted=None,
                       groups=None if self.groups is None else self.groups[idx])

    @property
    def prompt_items(self) -> np.ndarray:
        """The items the prompt alone is measured on (those whose options were scored)."""
        return np.arange(self.n) if self.prompted is None else np.flatnonzero(self.prompted)

    @property
    def n(self) -> int:
        return len(self.gold)

    def strata(self) -> list[str]:
        return ["|".join(map(str, np.flatnonzero(g))) for g in self.gold] if self.binary else [str(g) for g in self.gold]

    def counts(self) -> dict[str, int]:
        """Labelled items per option (binary: items where it is on)."""
        if self.binary:
            return {o: int(self.gold[:, k].sum()) for k, o in enumerate(self.options)}
        return {o: int((self.gold == k).sum()) for k, o in enumerate(self.options)}


@dataclass(frozen=True)
class Choice:
    """What the inner cross-validation chose."""

    C: float
    features: str
