"""Prefill the static prefix once; score batches of items and their candidates against it.

One forward pass per batch scores every candidate of every item. Each item contributes its own
tokens followed by a token trie of its candidates: candidate tokens attend to the cached prefix,
the item's tokens and their own ancestors in the trie, never to a sibling. So a label costs only
its tokens after the first (the first is scored from the item's last logits), and labels sharing
leading tokens share them in the trie. The lm_head runs only at the scored positions.

Two ways to run that forward, chosen once per engine:
- "shared" (default): the batch's tokens packed into one sequence, no padding, and the
  `prefixcache` attention kernel reading the shared prefix keys once for all rows (attention.py);
- "standard": padded rows (padding between prefix and item, so every row ends in the last
  column), a fresh `DynamicCache` starting from a broadcast view of the prefix, and an explicit 4D
  mask. Any model whose attention does not go through transformers' AttentionInterface uses it.
The shared prefix cache is never written to in either. Sliding-window layers (Mistral, Gemma 2/3,
Qwen2 with windows) see only the keys inside their window, in both paths; the prefix cache keeps
every position of every layer.
"""

from __future__ import annotations

import contextlib
import logging
import time
from typing import TYPE_CHECKING, Any, Callable, Iterator, Sequence

import numpy as np
import torch

from . import attention

from .. import compat
from .attention import UnsupportedAttention
from ..errors import ModelError, first_line
from .reference import score_naive
from .int8 import precision_of
from .kept import KeptLinear, kept_bytes
from .precision import precision_named
from .layout import Layout, Prefix, layout
from .rows import Probe, Row

log = logging.getLogger(__name__)

# Architectures whose shared-prefix path the test suite checks against a full re-encode. Others
# are checked once, on the first rows they score, against the standard path.
if TYPE_CHECKING:
    from transformers import PreTrainedModel
    from .branches import OpenItems

CHECKED_ARCHITECTURES = frozenset({"llama", "qwen2", "gpt2"})


def binding_window(lay: Layout, window: int | None) -> int | None:
    """`window` when it hides some earlier key from some token of the batch, else None."""
    return window if window is not None and int(lay.pos.max()) >= window else None


def within_window(lay: Layout, prefix_len: int, window: int) -> torch.Tensor:
    """`lay.allowed` narrowed to what a sliding-window layer sees: a key at position j is visible
    from position i only if j > i - window (transformers' convention). [B, W, P + W] bool."""
    B, W = lay.gather.shape
    slot_pos = torch.cat([lay.pos, lay.pos.new_zeros(1)])[lay.gather]  # [B, W]; padding slots at 0
    key_pos = torch.cat([torch.arange(prefix_len).expand(B, prefix_len), slot_pos], dim=1)  # [B, P + W]
    return lay.allowed & (key_pos[:, None, :] > slot_pos[:, :, None] - window)


def choose_backend(model: PreTrainedModel, asked: str = "auto") -> str:
    """"shared" when the model's attention goes through transformers' AttentionInterface (so the
    shared-prefix kernel can take its place), else "standard"; `asked` overrides ("auto": choose)."""
    if asked not in ("auto", "shared", "standard"):
        raise ValueError(f"unknown backend {asked!r}")
    if asked != "auto":
        return asked
    return "shared" if compat.can_set_attention(model) else "standard"


class Engine:
    """Scores candidates after prompts that start with one cached prefix: the transformers
    implementation of the engine protocol (model/protocol.py).

    Example:
        engine = Engine(model)
        prefix = engine.prefill(prefix_ids)
        logprobs = engine.score(prefix, [Row(ids, len(prefix_ids), [(12, 7), (40, 7)])])
        # logprobs[0][i] = sum of log p(candidate i's tokens | ids), float
    """

    name = "transformers"

    def __init__(self, model: PreTrainedModel, backend: str = "auto"):
        self.model = model
        self.device = next(model.parameters()).device
        self.dtype = next(model.parameters()).dtype
        self._cache_kw = compat.cache_kwarg(model)
        text = model.config.get_text_config()
        self.max_positions = getattr(text, "max_position_embeddings", None)
        # Sliding-window attention: which window, and whether only some layers use it.
        self.window: int | None = getattr(text, "sliding_window", None)
        kinds = set(getattr(text, "layer_types", None) or ())
        self._mixed_layers = self.window is not None and {"full_attention", "sliding_attention"} <= kinds
        if self.window is not None and kinds and "sliding_attention" not in kinds:
            self.window = None  # a window in the config that no layer uses (Qwen2 without use_sliding_window)
        self.backend = choose_backend(model, backend)
        # True until the first batch of an architecture the tests do not cover agreed with the standard path.
        self.unchecked = backend == "auto" and model.config.model_type not in CHECKED_ARCHITECTURES
        self._scored = False  # no batch scored yet: a failure then means the model is not supported
        self.label_tokens = 0  # candidate tokens fed after items (trie nodes), every call together
        self._full: Engine | None = None  # the padded path on the same model (`naive`)
        self._warm_up()

    naive_ways = ("item", "candidate")  # the slow, obviously correct paths `naive` offers

    def naive(self, row: Row, way: str) -> list[float]:
        """The row's candidates scored without the cached prefix (`bench`'s references): "item",
        one full forward of the whole prompt per row (padded path, every candidate in it);
        "candidate", one full forward per candidate (model/reference.py). `row.prefix_len` is 0."""
        if way == "candidate":
            return _per_candidate(self.model, row)
        if self._full is None:
            self._full = Engine(self.model, "standard")
        return self._full.score(Prefix((), (), torch.empty(0), 0.0), [row])[0]

    @property
    def threads(self) -> int:
        return torch.get_num_threads()

    @property
    def weights_bytes(self) -> int:
        """The bytes its weights take as held (a GGUF file's kept quantised: model/kept.py)."""
        return sum(p.numel() * p.element_size() for p in self.model.parameters()) + kept_bytes(self.model)

    def linear_params(self) -> tuple[int, int]:
        """(weights of all matmul layers except the lm_head, lm_head weights): what `bench` counts as work."""
        head = self.model.get_output_embeddings()
        body = sum(_weights_in(m) for m in self.model.modules() if m is not head and
                   (isinstance(m, (torch.nn.Linear, KeptLinear)) or type(m).__name__ == "Conv1D"))
        return body, _weights_in(head)

    def peak_gflops(self, seconds: float = 1.0) -> float | None:
        """Best of three timings of a large square matmul on this engine's device and dtype (int8:
        int8 operands, int32 sums: what its linear layers run)."""
        n = 2048
        if self.precision == "int8":
            a = torch.randint(-127, 128, (n, n), device=self.device, dtype=torch.int8)
            b = torch.randint(-127, 128, (n, n), device=self.device, dtype=torch.int8)
            product: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = torch._int_mm
        else:
            a = torch.randn(n, n, device=self.device, dtype=self.dtype)
            b = torch.randn(n, n, device=self.device, dtype=self.dtype)
            product = torch.matmul
        product(a, b)
        best = 0.0
        for _ in range(3):
            self.synchronize()
            start, reps = time.perf_counter(), 0
            while time.perf_counter() - start < seconds / 3:
                product(a, b)
                reps += 1
            self.synchronize()
            best = max(best, 2 * n**3 * reps / (time.perf_counter() - start) / 1e9)
        return best

    def synchronize(self) -> None:
        """Wait for the device's queued work (a timing's edge)."""
        if self.device.type == "cuda":
            torch.cuda.synchronize()

    @property
    def precision(self) -> str:
        """What it computes in, in words ("float32", "bfloat16", "int8")."""
        return precision_of(self.model) or str(self.dtype).removeprefix("torch.")

    def export_prefix(self, prefix: Prefix) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
        """What the prefix store keeps of a prefix: its last logits and each layer's keys and values."""
        tensors = {"logits": prefix.last_logits.detach().cpu().contiguous()}
        for i, (k, v) in enumerate(prefix.kv):
            tensors[f"k.{i}"], tensors[f"v.{i}"] = k.detach().cpu().contiguous(), v.detach().cpu().contiguous()
        return tensors, {"layers": str(len(prefix.kv))}

    def restore_prefix(self, ids: Sequence[int], tensors: dict[str, torch.Tensor], meta: dict[str, str],
                       load_ms: float) -> Prefix:
        """A prefix `export_prefix` gave, back on this engine's device; ValueError when it does
        not hold the whole prefix."""
        layers = int(meta["layers"])
        kv = tuple((tensors[f"k.{i}"].to(self.device), tensors[f"v.{i}"].to(self.device)) for i in range(layers))
        if any(k.shape[-2] != len(ids) or v.shape[-2] != len(ids) for k, v in kv):
            raise ValueError("a layer does not hold every prefix position")  # e.g. a sliding-window cache
        return Prefix(tuple(ids), kv, tensors["logits"].to(self.device), load_ms)

    @property
    def hidden_size(self) -> int:
        """The width of the state the lm_head reads (model/protocol.py)."""
        return int(self.model.config.get_text_config().hidden_size)

    @property
    def branches(self) -> bool:
        """Whether items can be kept between passes and trie nodes fed later (pruned scoring):
        the shared-prefix kernel, full attention, an architecture checked (model/protocol.py)."""
        return self.backend == "shared" and self.window is None and not self.unchecked

    def _fall_back(self, reason: UnsupportedAttention) -> None:
        """The only way the backend changes after it was chosen: the shared kernel said it cannot
        run this model's attention. Any other error in it is a bug and surfaces."""
        log.warning("shared-prefix attention is not usable with this model (%s); using padded batches", reason)
        self.backend = "standard"

    @torch.inference_mode()
    def _warm_up(self) -> None:
        """One small forward before any that counts. Measured here: the first forward of a
        process with 2 CPU threads now and then sums in another order (the thread pool is still
        starting), which moved a prefill's logits by ~1e-4 in one process out of ~8; after a
        warm-up, 40 of 40 processes agreed bit for bit. Same input, same records."""
        vocab = self.model.config.get_text_config().vocab_size
        ids = torch.arange(64, device=self.device)[None] % vocab  # [1, 64]
        self.model(input_ids=ids, use_cache=False, logits_to_keep=1)

    @torch.inference_mode()
    def prefill(self, ids: Sequence[int]) -> Prefix:
        start = time.perf_counter()
        if not ids:
            raise ValueError("the prefix is empty")
        input_ids = torch.tensor([list(ids)], device=self.device)  # [1, P]
        # A cache of full layers: a model's own cache would keep only the last `window` keys of
        # its sliding-window layers, and the rows' masks need every prefix position.
        kind, P = self.model.config.model_type, len(ids)
        try:
            out = self.model(input_ids=input_ids, use_cache=True, logits_to_keep=1,
                             **{self._cache_kw: compat.cache_from(())})
        except Exception as exc:
            # e.g. models with recurrent layers (Mamba, convolutions, linear attention) need a cache
            # of their own kind, which cannot be shared by rows the way keys and values are. For the
            # architectures the tests cover, a failure here is a bug, not a limitation.
            if kind in CHECKED_ARCHITECTURES:
                raise
            raise ModelError(f"{kind} models are not supported: prefilling the prompt prefix into a key/value "
                             f"cache failed ({type(exc).__name__}: {first_line(exc)[:200]})") from exc
        kv = compat.cache_layers(compat.returned_cache(out))
        layers = self.model.config.get_text_config().num_hidden_layers
        if len(kv) != layers or any(not isinstance(k, torch.Tensor) or k.shape[-2] != P or v.shape[-2] != P for k, v in kv):
            raise ModelError(f"{kind} models are not supported: their cache does not hold keys and values for every "
                             f"layer and position of the prompt prefix")
        last = out.logits[0, -1].float()  # [V]
        return Prefix(tuple(ids), kv, last, (time.perf_counter() - start) * 1000)

    def _mask(self, allowed: torch.Tensor) -> torch.Tensor:
        mask = torch.zeros(allowed.shape, dtype=self.dtype)
        return mask.masked_fill_(~allowed, torch.finfo(self.dtype).min).to(self.device)

    def forward_shared(self, prefix: Prefix, lay: Layout, capture: dict | None = None,
                       carried: tuple[tuple[torch.Tensor, torch.Tensor], ...] | None = None,
                       key_gather: torch.Tensor | None = None) -> torch.Tensor:
        """Packed tokens through the model on the shared prefix (the "shared" backend); returns
        logits at the kept positions, [R, V]. Two passes over the same rows (pruned scoring,
        model/branches.py): the first fills `capture` with each layer's keys and values of its
        tokens; a later one attends to them as `carried`, `key_gather` indexing carried + new keys
        (see attention.SharedPrefixState)."""
        dev, P = self.device, len(prefix.ids)
        built: dict[int | None, tuple[torch.Tensor, torch.Tensor | None]] = {}

        def mask_for(window: int | None) -> tuple[torch.Tensor, torch.Tensor | None]:
            window = binding_window(lay, window)
            if window not in built:
                allowed = lay.allowed if window is None else within_window(lay, P, window)
                own = self._mask(allowed[:, :, P:])[:, None]  # [B, 1, W, W]
                prefix_mask = None
                if not bool(allowed[:, :, :P].all()):  # some token may not see the whole prefix
                    per_token = allowed[:, :, :P].reshape(-1, P)[lay.slots]  # [T, P]
                    prefix_mask = self._mask(per_token)[None, None]  # [1, 1, T, P]
                built[window] = (own, prefix_mask)
            return built[window]

        gather = lay.gather.masked_fill(lay.gather == lay.ids.shape[0], 0).to(dev)  # padding -> token 0
        state = attention.SharedPrefixState(prefix.kv, gather, lay.slots.to(dev), mask_for, capture=capture,
                                            carried=carried, key_gather=key_gather)
        with compat.attention_implementation(self.model.config, attention.NAME), attention.scoring():
            out = self.model(
                input_ids=lay.ids[None].to(dev),  # [1, T]
                position_ids=lay.pos[None].to(dev),  # [1, T]
                use_cache=False,
                logits_to_keep=lay.keep.to(dev),  # [R]
                **{attention.STATE_KW: state},
            )
        return out.logits[0]  # [R, V]

    def _forward_standard(self, prefix: Prefix, lay: Layout) -> torch.Tensor:
        """Padded rows on a broadcast copy of the prefix cache; returns logits at kept positions."""
        B, W = lay.gather.shape
        ids = torch.cat([lay.ids, lay.ids.new_zeros(1)])[lay.gather]  # [B, W]
        pos = torch.cat([lay.pos, lay.pos.new_zeros(1)])[lay.gather]  # [B, W]
        # Rows are right-aligned, so every kept position lies in the last K columns.
        K = int(W - (lay.slots[lay.keep] % W).min())
        cache = {}
        if prefix.ids:  # an empty prefix means a full re-encode (bench's naive mode)
            kv = [(k.expand(B, -1, -1, -1), v.expand(B, -1, -1, -1)) for k, v in prefix.kv]
            cache = {self._cache_kw: compat.cache_from(kv)}
        out = self.model(
            input_ids=ids.to(self.device),
            position_ids=pos.to(self.device),
            attention_mask=self._standard_mask(lay, len(prefix.ids)),
            use_cache=bool(cache),
            # the last K positions as an index, not an int: an int slices the hidden states into a
            # strided tensor, on which the lm_head's matmul copies its weight once per row (in
            # bfloat16 70x slower, and rows x the head's size in memory)
            logits_to_keep=torch.arange(W - K, W, device=self.device),
            **cache,
        )
        flat = out.logits.reshape(B * K, -1)  # [B * K, V]
        b, w = lay.slots[lay.keep] // W, lay.slots[lay.keep] % W
        return flat[(b * K + w - (W - K)).to(flat.device)]  # [R, V]

    @staticmethod
    def _standard_kept(lay: Layout, hidden: torch.Tensor) -> torch.Tensor:
        """The padded path's lm_head input [B, K, H] at the kept positions, [R, H] (as its logits)."""
        B, K, H = hidden.shape
        W = lay.gather.shape[1]
        b, w = lay.slots[lay.keep] // W, lay.slots[lay.keep] % W
        return hidden.reshape(B * K, H)[(b * K + w - (W - K)).to(hidden.device)]  # [R, H]

    @staticmethod
    def _packed(lay: Layout, found: torch.Tensor) -> torch.Tensor:
        """A layer's states of one forward as packed tokens, [T, H]: the shared path's [1, T, H] as
        it is, the padded path's [B, W, H] read at each packed token's slot."""
        T = lay.ids.shape[0]
        if found.shape[0] == 1 and found.shape[1] == T:
            return found[0]
        return found.reshape(-1, found.shape[-1])[lay.slots.to(found.device)]  # [T, H]

    def _probed(self, lay: Layout, probe: Probe, seen: dict, wanted: Sequence[Sequence[int]]) -> list[np.ndarray]:
        """Per row, the probe's states: at each wanted answer position, then the mean over the
        row's own tokens, for each layer: [len(wanted[b]) (+ 1), len(probe.layers), H] float32."""
        stacked = torch.stack([self._packed(lay, seen[i]) for i in probe.layers], dim=1)  # [T, L, H]
        out = []
        for b, cands in enumerate(wanted):
            at = lay.keep[[lay.firsts[b][i] for i in cands]].to(stacked.device)  # packed answer positions
            parts = [stacked[at].float()]  # [n, L, H]
            if probe.mean:
                start, end = lay.owns[b]
                parts.append(stacked[start:end].float().mean(dim=0, keepdim=True))  # [1, L, H]
            out.append(torch.cat(parts).cpu().numpy())
        return out

    def _standard_mask(self, lay: Layout, P: int) -> torch.Tensor | dict[str, torch.Tensor]:
        """The explicit [B, 1, W, P + W] mask; for a model mixing full and sliding-window layers,
        one per layer type (a 4D mask given alone would be used by both)."""
        full = self._mask(lay.allowed)[:, None]
        window = binding_window(lay, self.window)
        if window is None:
            return {"full_attention": full, "sliding_attention": full} if self._mixed_layers else full
        windowed = self._mask(within_window(lay, P, window))[:, None]
        return {"full_attention": full, "sliding_attention": windowed} if self._mixed_layers else windowed

    def _standard_or_unsupported(self, prefix: Prefix, lay: Layout) -> torch.Tensor:
        """The padded path; failing on the first batch of an architecture the tests do not cover
        (one that takes no 4D mask or no cache object, such as ALiBi models), a ModelError."""
        try:
            return self._forward_standard(prefix, lay)
        except (ValueError, RuntimeError, TypeError, IndexError) as exc:
            kind = self.model.config.model_type
            if self._scored or kind in CHECKED_ARCHITECTURES:
                raise
            raise ModelError(f"{kind} models are not supported: scoring after a cached prefix failed "
                             f"({type(exc).__name__}: {first_line(exc)[:200]})") from exc

    def _check_shared(self, shared: torch.Tensor, standard: torch.Tensor) -> None:
        """First batch of an architecture the tests do not cover: both paths must agree."""
        self.unchecked = False
        tol = precision_named(self.precision).tolerance
        diff = (torch.log_softmax(shared.float(), -1) - torch.log_softmax(standard.float(), -1)).abs().max()
        if not bool(diff <= tol):
            raise UnsupportedAttention(f"its scores differ from the standard path by {float(diff):.2g}")

    def score(self, prefix: Prefix, rows: Sequence[Row]) -> list[list[float]]:
        """Summed log-probabilities, one list per row, one float per candidate (in order)."""
        return self._score(prefix, rows, None)[0]

    def open_items(self, prefix: Prefix, rows: Sequence[Row]) -> Iterator["OpenItems"]:
        """The rows opened for a race (model/branches.py): one group, the batch the caller sized."""
        from .branches import open_items

        yield open_items(self, prefix, rows)

    def score_with_states(self, prefix: Prefix, rows: Sequence[Row], wanted: Sequence[Sequence[int]],
                          probe: Probe | None = None) -> tuple[list[list[float]], list[np.ndarray]]:
        """`score`, and per row the final hidden state (after the last norm: what the lm_head
        reads) at the answer position of each candidate in `wanted[b]` (indices into the row's
        candidates), float32 [len(wanted[b]), H]. The same forward computes both: the states are
        those the candidates' first tokens are scored from. With a `probe` that is not plain, per
        row [len(wanted[b]) (+ 1: the mean over its own tokens, last), len(probe.layers), H]."""
        return self._score(prefix, rows, wanted, None if probe is None or probe.plain else probe)

    @property
    def layers(self) -> int:
        """Decoder layers whose states a probe may read (1..layers); 0 when they cannot be found."""
        try:
            return len(compat.decoder_layers(self.model))
        except compat.NoLayers:
            return 0

    @torch.inference_mode()
    def _score(self, prefix: Prefix, rows: Sequence[Row], wanted: Sequence[Sequence[int]] | None,
               probe: Probe | None = None) -> tuple[list[list[float]], list[np.ndarray]]:
        P = len(prefix.ids)
        _check_rows(P, rows)
        lay = layout(P, rows)
        self.label_tokens += len(lay.ids) - sum(len(r.ids) - r.prefix_len for r in rows)
        logits: torch.Tensor | None = None
        hidden: torch.Tensor | None = None
        states: list[Any] = []  # the lm_head's input of each forward
        seen: dict[int, torch.Tensor] = {}  # the probe's layers
        with contextlib.ExitStack() as stack:
            if wanted is not None:
                stack.enter_context(compat.scored_states(self.model, states))
            if probe is not None:
                stack.enter_context(compat.layer_states(self.model, probe.layers, seen))
            if self.backend == "shared":
                try:
                    logits = self.forward_shared(prefix, lay)
                    hidden = states[-1][0] if wanted is not None else None  # [R, H]
                    if self.unchecked:
                        self._check_shared(logits, self._standard_or_unsupported(prefix, lay))
                except attention.UnsupportedAttention as exc:
                    self._fall_back(exc)
                    logits = None
            if logits is None:
                logits = self._standard_or_unsupported(prefix, lay)
                hidden = self._standard_kept(lay, states[-1]) if wanted is not None else None
        self._scored = True
        picked_states = []
        if wanted is not None and probe is not None:
            picked_states = self._probed(lay, probe, seen, wanted)
        elif wanted is not None:
            assert hidden is not None  # read with the logits when states are wanted
            for b, cands in enumerate(wanted):
                at = torch.tensor([lay.firsts[b][i] for i in cands], dtype=torch.long, device=hidden.device)
                picked_states.append(hidden[at].float().cpu().numpy())  # [len(cands), H]
        # log p = logit - logsumexp(logits): a reduction over the vocabulary, no [R, V] written.
        rows_, toks = lay.term_rows.to(logits.device), lay.term_toks.to(logits.device)
        lse = torch.logsumexp(logits.float(), dim=-1)  # [R]
        picked = (logits[rows_, toks].float() - lse[rows_]).tolist()  # [C]
        results, at_pick = [], 0
        for sizes in lay.sizes:
            row = []
            for n in sizes:
                row.append(float(sum(picked[at_pick: at_pick + n])))
                at_pick += n
            results.append(row)
        return results, picked_states


def _check_rows(prefix_len: int, rows: Sequence[Row]) -> None:
    for r in rows:
        if (not 0 <= r.prefix_len <= prefix_len or r.prefix_len >= len(r.ids)
                or any(len(c) <= r.skip(i) for i, c in enumerate(r.candidates))):
            raise ValueError("each row needs a prefix_len <= the prefix, own ids, and candidates with ids to score")


def _weights_in(module: torch.nn.Module) -> int:
    """How many weights a linear (or Conv1D) layer multiplies by, kept quantised or not."""
    if isinstance(module, KeptLinear):
        return module.in_features * module.out_features
    weight = module.weight
    assert isinstance(weight, torch.Tensor)
    return weight.numel()


def _per_candidate(model: PreTrainedModel, row: Row) -> list[float]:
    """A full forward per candidate; a typed question's text before its answer is read, not scored."""
    if not row.skips:
        return score_naive(model, row.ids, row.candidates)
    return [score_naive(model, list(row.ids) + list(c[:s]), [c[s:]])[0] for c, s in zip(row.candidates, row.skips)]
