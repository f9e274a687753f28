"""Attention over one shared prefix without copying it per batch row (cascade attention).

Registered with transformers' `AttentionInterface` as "prefixcache". During a scoring forward the
model runs on the batch's real tokens packed into one sequence, so no padding reaches the linear
layers. Each attention layer then works in two parts and merges them by their log-sum-exp:
- prefix part: all packed queries against the shared prefix keys in one call (the batch folded into
  the query length, query heads grouped onto their kv head), so the prefix is read once per layer,
  never expanded per row;
- own part: queries spread into padded rows against the row's own keys, under the row's mask
  (causal over the item, a candidate sees the item and its trie ancestors only).
A sliding-window layer (transformers passes its `sliding_window`) gets masks narrowed to its
window. On the CPU both parts use PyTorch's fused flash-attention kernel, which returns the log-sum-exp;
elsewhere the same maths runs as plain matmuls.

Outside a scoring forward (no `prefixcache_state` kwarg) it defers to PyTorch SDPA.
"""

from __future__ import annotations

from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

import torch
from transformers import AttentionInterface

from .. import compat

NAME = "prefixcache"
STATE_KW = "prefixcache_state"
_SCORING: ContextVar[bool] = ContextVar("prefixcache_scoring", default=False)
_FLASH_CPU = compat.flash_attention_cpu()
_SDPA = compat.sdpa_forward()


class UnsupportedAttention(RuntimeError):
    """The model's attention needs something this kernel does not do (softcap, sinks, biases)."""


@dataclass(frozen=True)
class SharedPrefixState:
    """What a scoring forward's attention layers need besides q, k, v.

    prefix_kv[layer] = (keys, values), each [1, kv_heads, P, head_dim]
    gather: [B, W] packed index of each padded slot (padding slots repeat index 0: they are
        masked as keys and their outputs are dropped)
    slots: [T] flat index (b * W + w) of each packed token
    mask_for(window): the additive masks of a layer with that sliding window (None: full
        attention): own [B, 1, W, W], 0 where a slot may attend to a slot of its row, and prefix
        [1, 1, T, P], or None when every token may attend to the whole prefix
    """

    prefix_kv: tuple[tuple[torch.Tensor, torch.Tensor], ...]
    gather: torch.Tensor
    slots: torch.Tensor
    mask_for: Callable[[int | None], tuple[torch.Tensor, torch.Tensor | None]]
    _grouped: dict = field(default_factory=dict, compare=False)
    # Two-pass scoring (pruned label scoring): the first pass keeps each layer's packed keys and
    # values in `capture`; a later pass over other tokens of the same rows attends to them as
    # `carried[layer]` ([1, Hkv, T1, D] each), its own keys then gathered from carried + new
    # (`key_gather` [B, Wk] indexes that concatenation; the own mask is [B, 1, W, Wk]).
    capture: dict | None = None
    carried: tuple[tuple[torch.Tensor, torch.Tensor], ...] | None = None
    key_gather: torch.Tensor | None = None

    def masks(self, g: int, window: int | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The masks for g query heads folded onto each kv head (query rows repeated g times)."""
        if (g, window) not in self._grouped:
            own, pre = self.mask_for(window)
            own = own.repeat(1, 1, g, 1)  # [B, 1, gW, W]
            pre = pre.repeat(1, 1, g, 1) if pre is not None else None  # [1, 1, gT, P]
            self._grouped[g, window] = (own, pre)
        return self._grouped[g, window]


def _part(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, scale: float
          ) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax attention of q [N, H, L, D] over k, v [N, H, S, D] with an additive mask
    [N or 1, 1, L, S] (or None). Returns (out [N, H, L, D], log-sum-exp [N, H, L], float32)."""
    if _FLASH_CPU is not None and q.device.type == "cpu" and q.dtype in (torch.float32, torch.bfloat16):
        out, lse = _FLASH_CPU(q, k, v, 0.0, False, attn_mask=mask, scale=scale)
        return out, lse.float()
    scores = torch.matmul(q.float(), k.float().transpose(-1, -2)) * scale  # [N, H, L, S]
    if mask is not None:
        scores = scores + mask
    lse = torch.logsumexp(scores, dim=-1)  # [N, H, L]
    out = torch.matmul(torch.exp(scores - lse[..., None]).to(v.dtype), v)
    return out, lse


def _to_rows(x: torch.Tensor, gather: torch.Tensor) -> torch.Tensor:
    """[1, H, T, D] packed -> [B, H, W, D] padded."""
    return x[0][:, gather].transpose(0, 1)


def shared_prefix_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                            attention_mask: torch.Tensor | None, scaling: float | None = None, dropout: float = 0.0,
                            **kwargs: Any) -> tuple[torch.Tensor, None]:
    state: SharedPrefixState | None = kwargs.get(STATE_KW)
    if state is None:
        if _SCORING.get():  # a model whose layers drop the extra kwarg: it would never see the prefix
            raise UnsupportedAttention("its layers do not pass attention arguments through")
        return _SDPA(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout, **kwargs)
    if any(kwargs.get(k) is not None for k in ("softcap", "position_bias", "s_aux", "sinks")):
        raise UnsupportedAttention("attention with softcap, sinks or position bias")
    layer = getattr(module, "layer_idx", None)
    if layer is None:
        raise UnsupportedAttention("its attention layers do not carry their layer index")
    kp, vp = state.prefix_kv[layer]  # [1, Hkv, P, D]
    B, W = state.gather.shape
    _, Hq, T, D = query.shape
    Hkv = key.shape[1]
    g = Hq // Hkv
    scale = scaling if scaling is not None else D ** -0.5

    # Query head h uses kv head h // g: fold each kv head's g query heads into its query rows.
    mask_own, mask_pre = state.masks(g, kwargs.get("sliding_window"))
    out_pre, lse_pre = _part(query.reshape(1, Hkv, g * T, D), kp, vp, mask_pre, scale)  # [1, Hkv, gT, D]
    out_pre = out_pre.reshape(Hq, T, D).transpose(0, 1)  # [T, Hq, D]
    lse_pre = lse_pre.reshape(Hq, T).transpose(0, 1)  # [T, Hq]
    if mask_pre is not None:  # tokens that may see no prefix key (a row sharing no prefix id, a window)
        out_pre = torch.nan_to_num(out_pre)

    # Own part, in padded rows; back to packed order through `slots`.
    if state.capture is not None:
        state.capture[layer] = (key, value)
    q_own = _to_rows(query, state.gather).reshape(B, Hkv, g * W, D)  # [B, Hkv, gW, D]
    if state.carried is not None:  # the row's earlier tokens, then its own: [B, Hkv, Wk, D]
        kc, vc = state.carried[layer]
        assert state.key_gather is not None  # set with the carried keys
        k_own = _to_rows(torch.cat([kc, key], dim=2), state.key_gather)
        v_own = _to_rows(torch.cat([vc, value], dim=2), state.key_gather)
    else:
        k_own, v_own = _to_rows(key, state.gather), _to_rows(value, state.gather)  # [B, Hkv, W, D]
    out_own, lse_own = _part(q_own, k_own, v_own, mask_own, scale)
    out_own = out_own.reshape(B, Hq, W, D).transpose(1, 2).reshape(B * W, Hq, D)[state.slots]  # [T, Hq, D]
    lse_own = lse_own.reshape(B, Hq, W).transpose(1, 2).reshape(B * W, Hq)[state.slots]  # [T, Hq]

    lse = torch.logaddexp(lse_pre, lse_own)  # [T, Hq]
    out = out_pre * torch.exp(lse_pre - lse)[..., None].to(out_own.dtype)
    out += out_own * torch.exp(lse_own - lse)[..., None].to(out_own.dtype)
    return out[None], None  # [1, T, Hq, D]


@contextmanager
def scoring() -> Iterator[None]:
    """Marks a scoring forward: every attention call in it must receive the shared-prefix state."""
    token = _SCORING.set(True)
    try:
        yield
    finally:
        _SCORING.reset(token)


AttentionInterface.register(NAME, shared_prefix_attention)
