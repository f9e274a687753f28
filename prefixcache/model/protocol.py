"""What the rest of the program may ask of an engine: the seam between scoring and whatever runs
the model. `Engine` (model/engine.py, transformers on torch) and `LlamaEngine`
(model/llamacpp.py, a GGUF file on llama.cpp) implement it; the scorer, pruning, the prefix store's callers, `serve`/`decide`, `tune`, `fit` and the Python API use only
these members (tests/test_layers.py holds them to it; `bench` alone also times the transformers
engine's internals, which it says are that engine's).

A prefix is an opaque handle made by `prefill` and given back to `score`: callers read its `ids`
only. Rows (model/rows.py) are plain token ids: an item's prompt after the prefix and its
candidates, each candidate's tokens scored after the prompt. What comes back is plain Python
floats and numpy arrays, never a tensor.
"""

from __future__ import annotations

from typing import Any, Iterator, Protocol, Sequence, runtime_checkable

import numpy as np

from .rows import Node, Probe, Row


class PrefixHandle(Protocol):
    """An engine's prefilled prefix, opaque: callers read its `ids` and `prefill_ms` only."""

    ids: tuple[int, ...]
    prefill_ms: float


class OpenedItems(Protocol):
    """A group of rows whose own tokens went through the model once and are kept, so that chosen
    trie nodes (candidate prefixes) can be fed later, each attending to the prefix, its row and
    its ancestors, never run twice (pruned scoring, scoring/pruning.py)."""

    rows: Sequence[Row]

    def firsts(self, b: int) -> dict[Node, float]:
        """Row b's candidates' first tokens (the nodes right after the row) and their log-probs."""

    def feed(self, nodes: dict[int, Sequence[Node]]) -> dict[int, dict[Node, float]]:
        """Run the named nodes of the named rows (and their ancestors not fed yet) in one pass;
        per row, every child of a fed node and the log-probability of its last token there."""


class ScoringEngine(Protocol):
    """An engine that scores candidates after prompts sharing one prefilled prefix.

    Attributes:
        name: which engine it is ("transformers", "llama.cpp"): records and reports name it.
        device: where it runs (a `torch.device` or a name; `str(device)` names it: "cpu", "cuda:0").
        precision: the precision it computes in, in words ("float32", "bfloat16", a GGUF file's types).
        max_positions: the longest prompt with its candidates it can read, or None when unbounded.
        hidden_size: the width of the state its lm_head reads (what a fitted head takes).
        branches: whether it keeps an item's keys and values between passes, so that a race can
            feed trie nodes later (pruned scoring, scoring/pruning.py); without it every candidate is
            scored to the end.
    """

    name: str
    device: Any
    max_positions: int | None

    @property
    def hidden_size(self) -> int: ...

    @property
    def branches(self) -> bool: ...

    @property
    def precision(self) -> str:
        """What it computes in, in words: "float32", or a GGUF file's type ("Q4_1")."""

    def export_prefix(self, prefix: Any) -> tuple[dict[str, Any], dict[str, str]]:
        """What the prefix store keeps of a prefix: named arrays (torch tensors or numpy) and a
        header of strings; `restore_prefix` takes them back."""

    def restore_prefix(self, ids: Sequence[int], tensors: dict[str, Any], meta: dict[str, str],
                       load_ms: float) -> Any:
        """A prefix `export_prefix` gave, ready to score with; ValueError when it is not whole."""

    def prefill(self, ids: Sequence[int]) -> Any:
        """The prefix `ids` run once and kept: a handle with `.ids` to give to `score`."""

    def score(self, prefix: Any, rows: Sequence[Row]) -> list[list[float]]:
        """Per row, per candidate in order, the summed log-probability of its tokens after the
        prefix and the row's own tokens."""

    def open_items(self, prefix: Any, rows: Sequence[Row]) -> Iterator[OpenedItems]:
        """The rows in order, in consecutive groups, each opened (its own tokens run and kept)
        when the one before is done with; only where `branches` is true."""

    @property
    def layers(self) -> int:
        """Decoder layers whose states a `Probe` may read besides the final one (1..layers), and
        the means it may take; 0: this engine reads the final state at answer positions only."""

    def score_with_states(self, prefix: Any, rows: Sequence[Row], wanted: Sequence[Sequence[int]],
                          probe: Probe | None = None) -> tuple[list[list[float]], list[np.ndarray]]:
        """`score`, and per row the final hidden state [len(wanted[b]), hidden_size] (float32) at the
        position each candidate in `wanted[b]` has its first token scored from, from the same pass.
        With a probe that is not plain (only where `layers` > 0): per row [len(wanted[b]) (+ 1:
        the mean over the row's own tokens, last), len(probe.layers), hidden_size]."""


@runtime_checkable
class TimedEngine(ScoringEngine, Protocol):
    """What `bench` also asks of an engine, to time it against slower references and count its work.

    Attributes:
        naive_ways: the reference paths `naive` offers: "item" (a full forward of the whole prompt per
            row), "candidate" (one per candidate), and where the engine has one, "rewound" (its own
            one-prompt-at-a-time path, rewound to what a prompt shares with the last), and "first" (its
            cheapest ranking: each candidate's first token alone, after the prompt rewound as "rewound").
        threads: CPU threads it computes with.
        weights_bytes: the weights it holds in memory as a copy of its own (0: the file as read).
        label_tokens: candidate tokens fed after items so far (every call together): what `bench`
            counts of a mode's work.
    """

    naive_ways: tuple[str, ...]
    threads: int
    weights_bytes: int
    label_tokens: int

    def naive(self, row: Row, way: str) -> list[float]:
        """The row's candidates scored by the reference path `way`, no prefix (`row.prefix_len` 0)."""

    def linear_params(self) -> tuple[int, int]:
        """(numbers in the layers every token goes through, numbers in the output layer)."""

    def peak_gflops(self, seconds: float = 1.0) -> float | None:
        """The device's measured matrix-product peak at its precision; None where none compares."""

    def synchronize(self) -> None:
        """Wait for the device's queued work (the edges of a timing)."""


MEMBERS = frozenset({"name", "device", "precision", "export_prefix", "restore_prefix", "max_positions", "hidden_size", "branches", "prefill", "score", "open_items",
                     "score_with_states", "layers"})  # what callers outside model/ may read of an engine
TIMED = frozenset({"naive_ways", "threads", "weights_bytes", "label_tokens", "naive", "linear_params", "peak_gflops",
                   "synchronize"})


def timed(engine: ScoringEngine) -> TimedEngine:
    """`engine` with what `bench` reads of it (TypeError for an engine without it: `bench` times
    the engines that offer its reference paths and counts)."""
    if not isinstance(engine, TimedEngine):
        raise TypeError(f"the {engine.name} engine offers no reference paths and counts for bench")
    return engine
