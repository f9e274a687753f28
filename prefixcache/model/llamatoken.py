"""One token of a llama.cpp decode batch, as the llama.cpp engine (llamacpp.py) and its kept
branches (llamabranches.py) lay batches out: both import it from here, neither from the other."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class Token:
    """A token to decode: its id, its position, the sequences it joins (their cells see it), and
    whether its logits are kept."""

    id: int
    pos: int
    seqs: list[int]
    logits: bool
