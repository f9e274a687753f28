"""The slow, obviously correct scorer: one full forward pass per (prompt, candidate).

Used by the tests (and `bench`) to check the cached, batched engine token for token.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Sequence

import torch

if TYPE_CHECKING:
    from transformers import PreTrainedModel


@torch.inference_mode()
def score_naive(model: PreTrainedModel, prompt_ids: Sequence[int], candidates: Sequence[Sequence[int]]) -> list[float]:
    """Sum of log p(candidate tokens | prompt), re-encoding prompt + candidate from scratch."""
    device = next(model.parameters()).device
    scores = []
    for cand in candidates:
        ids = torch.tensor([list(prompt_ids) + list(cand)], device=device)  # [1, T]
        logits = model(input_ids=ids, use_cache=False).logits[0].float()  # [T, V]
        logprobs = torch.log_softmax(logits, dim=-1)
        start = len(prompt_ids)
        scores.append(float(sum(logprobs[start - 1 + k, tok] for k, tok in enumerate(cand))))
    return scores
