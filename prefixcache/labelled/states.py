"""The labelled items' states and scores kept on disk between fits (`<cache>/states/`), row by
row, so an interrupted `fit` continues where it stopped and a fit of a grown file, another fold
or another subset reads back every row already read. No torch here.

What a row's entry depends on names the folder: the task's fingerprint (model, prefix, item
prompt, questions), the engine, the precision and device, which questions are read and how, the
views read (task/features.py) and whether it holds the options' scores. A row is found by its
prompt's digest (`Prepared.key`). Each forward's rows are one file (safetensors: per question
read and view its states, float32, and where the options were scored their log-probabilities,
float64; the rows' digests in the header), written whole or not at all.
"""

from __future__ import annotations

import hashlib
import json
import logging
from pathlib import Path
from typing import Any, Mapping, Optional, Sequence

import numpy as np

from .. import safefile
from ..model.cache import states_dir
from ..model.private import ForeignCache, private_folder
from ..task.head import metadata_of

log = logging.getLogger(__name__)
Views = dict[str, np.ndarray]  # a question's views of one row, each [U, H]
Entry = tuple[Optional[list[float]], list[Views]]  # a row's options' log-probs (None: not scored), per question read


def item_digest(key: tuple) -> str:
    """A prepared item's prompt key (`Prepared.key`) as a file-safe digest."""
    return hashlib.sha256(json.dumps(key, default=list).encode()).hexdigest()[:32]


class StateStore:
    """One kind of row entry on disk (see the module's docstring). `entries` holds what was read."""

    def __init__(self, cache_dir: Path, fingerprint: Mapping[str, str], engine: str, dtype: str, device: str,
                 reads: Sequence[Any], views: Sequence[str], scores: bool):
        name = hashlib.sha256(json.dumps([dict(fingerprint), engine, dtype, device, list(reads), list(views), scores],
                                         sort_keys=True).encode())
        self.folder: Path | None = states_dir(cache_dir) / name.hexdigest()[:32]
        self.views, self.scores = tuple(views), scores
        self.entries: dict[str, Entry] = {}
        try:
            private_folder(self.folder)
        except (ForeignCache, OSError) as exc:
            log.warning("the states of this fit are not kept (%s): an interrupted fit starts again", exc)
            self.folder = None
            return
        for path in sorted(self.folder.glob("*.safetensors")):
            self._read(path)

    def _read(self, path: Path) -> None:
        from safetensors import SafetensorError
        from safetensors.numpy import load

        data = path.read_bytes()
        try:
            arrays = load(data)
            meta = metadata_of(data)
            digests, questions = json.loads(meta["items"]), int(meta["questions"])
            for n, digest in enumerate(digests):
                lps = arrays["logprobs"][n].tolist() if self.scores else None
                per = [{v: arrays[f"q{k}/{v}"][n] for v in self.views} for k in range(questions)]
                self.entries[digest] = (lps, per)
        except (SafetensorError, ValueError, KeyError, IndexError, TypeError):
            log.warning("%s: not a readable batch of states; its items are read again", path)

    def get(self, key: tuple) -> Entry | None:
        """The row's entry, when kept."""
        return self.entries.get(item_digest(key))

    def put(self, keys: Sequence[tuple], logprobs: Sequence[Sequence[float]] | None, states: Sequence[list[Views]]
            ) -> None:
        """Keep the entries of one forward's rows (a file of their own, written whole)."""
        from safetensors.numpy import save

        digests = [item_digest(k) for k in keys]
        for n, digest in enumerate(digests):
            self.entries[digest] = (list(logprobs[n]) if logprobs is not None else None, list(states[n]))
        if self.folder is None or not keys:
            return
        arrays: dict[str, np.ndarray] = {}
        if logprobs is not None:
            arrays["logprobs"] = np.array(logprobs, dtype=np.float64)
        questions = len(states[0])
        for q in range(questions):
            for v in self.views:
                arrays[f"q{q}/{v}"] = np.stack([s[q][v] for s in states]).astype(np.float32)
        name = hashlib.sha256("".join(digests).encode()).hexdigest()[:32]
        meta = {"items": json.dumps(digests), "questions": str(questions)}
        try:
            safefile.replace(self.folder / f"{name}.safetensors", save(arrays, metadata=meta), "a batch of states")
        except OSError as exc:
            log.warning("a batch of states could not be kept (%s): an interrupted fit reads it again", exc)
