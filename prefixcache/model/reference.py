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
        # logits at the last len(cand) + 1 positions only (the rest are not read): [len(cand) + 1, V]
        logits = model(input_ids=ids, use_cache=False, logits_to_keep=len(cand) + 1).logits[0].float()
        logprobs = torch.log_softmax(logits, dim=-1)
        scores.append(float(sum(logprobs[k, tok] for k, tok in enumerate(cand))))  # position k predicts cand[k]
    return scores
