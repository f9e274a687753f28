"""The labelled items' states kept on disk between fits (`<cache>/states/`), so an interrupted
`fit` continues where it stopped and a fit again with other folds or a seed costs no forward pass.
No torch here.

A fit's states depend on the task's fingerprint (model, prefix, item prompt, questions), the
precision and device, and which questions are read: those name the folder. Each batch of `run`'s
batches is one file (safetensors: each item's options' log-probabilities, float64, and per question
read its states, float32; the items' prompt digests in the header), written whole or not at all. A
batch whose every item is there is read back instead of scored; the batches are the same as in an
uninterrupted fit, so the states are the same bit for bit.
"""

from __future__ import annotations

import hashlib
import json
import logging
from pathlib import Path
from typing import Any, Mapping, Sequence

import numpy as np

from .. import safefile
from ..model.cache import states_dir
from ..model.private import ForeignCache, private_folder
from ..task.head import metadata_of

log = logging.getLogger(__name__)
Entry = tuple[list[float], list[np.ndarray]]  # an item's options' log-probs, and per question read its states


def item_digest(key: tuple) -> str:
    """A prepared item's prompt key (`Prepared.key`) as a file-safe digest."""
    return hashlib.sha256(json.dumps(key, default=list).encode()).hexdigest()[:32]


class StateStore:
    """One fit's states on disk (see the module's docstring). `entries` holds what was read back."""

    def __init__(self, cache_dir: Path, fingerprint: Mapping[str, str], dtype: str, device: str,
                 reads: Sequence[Any]):
        name = hashlib.sha256(json.dumps([dict(fingerprint), dtype, device, list(reads)], sort_keys=True).encode())
        self.folder = states_dir(cache_dir) / name.hexdigest()[:32]
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
            digests = json.loads(metadata_of(data)["items"])
            for n, digest in enumerate(digests):
                states = [arrays[f"q{k}"][n] for k in range(sum(1 for a in arrays if a.startswith("q")))]
                self.entries[digest] = (arrays["logprobs"][n].tolist(), states)
        except (SafetensorError, ValueError, KeyError, IndexError, TypeError):
            log.warning("%s: not a readable batch of states; its items are scored again", path)

    def get(self, keys: Sequence[tuple]) -> list[Entry] | None:
        """The entries of a batch's items, when every one is kept; else None."""
        found = [self.entries.get(item_digest(k)) for k in keys]
        return None if any(f is None for f in found) else found

    def put(self, keys: Sequence[tuple], logprobs: Sequence[Sequence[float]], states: Sequence[Sequence[np.ndarray]]
            ) -> None:
        """Keep a batch's entries (a file of its own, written whole)."""
        from safetensors.numpy import save

        if self.folder is None or not keys:
            return
        digests = [item_digest(k) for k in keys]
        arrays = {"logprobs": np.array(logprobs, dtype=np.float64)}
        for q in range(len(states[0])):
            arrays[f"q{q}"] = np.stack([s[q] for s in states]).astype(np.float32)
        name = hashlib.sha256("".join(digests).encode()).hexdigest()[:32]
        try:
            safefile.replace(self.folder / f"{name}.safetensors", save(arrays, metadata={"items": json.dumps(digests)}),
                             "a batch of states")
        except OSError as exc:
            log.warning("a batch of states could not be kept (%s): an interrupted fit scores it again", exc)
            return
        for digest, lp, st in zip(digests, logprobs, states):
            self.entries[digest] = (list(lp), list(st))
