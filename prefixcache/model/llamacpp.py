"""The llama.cpp engine: a GGUF file run as it is (Q4_K_M, Q8_0, F16, F32: whatever llama.cpp
reads), never converted, through llama-cpp-python's low-level API. It implements the engine
protocol (model/protocol.py) with the transformers engine's numbers for the same weights, to
llama.cpp's arithmetic (quantised files multiply in quantised activations).

How a batch runs. The prefix is decoded once into sequence 0 of a context whose key/value cells
are one buffer for every sequence (`kv_unified`). A batch's rows are then decoded together in one
`llama_decode`: every token carries the sequence ids allowed to see it, and attention reads a cell
from a token only when they share a sequence and the cell's position is not later. Each row gets
one sequence per leaf of its candidates' token trie (one when it has no trie): `seq_cp` adds those
ids to the prefix cells the row shares (a tag on the cells, no copy), the row's own tokens carry
all of them, a trie node carries the leaves below it. So a node sees the prefix, its item and its
ancestors, never a sibling or another row: the transformers engine's mask, built from sequences.
Logits are asked only where a candidate token is scored; `seq_rm` drops the row's ids after the
batch, which frees every cell but the prefix's. A race (pruned scoring) keeps a group's rows
between decodes, a sequence for each branch it feeds, and feeds trie nodes later (`open_items`,
model/llamabranches.py).

Knows nothing of specs or items; llama_cpp is imported when an engine is made.
"""

from __future__ import annotations

import ctypes
import logging
import math
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterator, Sequence

import numpy as np

from ..errors import ModelError
from .llamatoken import Token
from .rows import Probe, Row, Trie, trie
from .ggufheader import check_gguf

if TYPE_CHECKING:
    from .llamabranches import LlamaOpenItems

log = logging.getLogger(__name__)

MAX_SEQUENCES = 256  # llama.cpp's bound on the sequences of one context (LLAMA_MAX_SEQ)
DECODE_TOKENS = 2048  # tokens one decode takes at most (rows are split into decodes below it)
UBATCH_TOKENS = 512  # the micro-batch where memory is short; else a decode is one micro-batch (DECODE_TOKENS)
GPU_LAYERS = 999  # offload every layer when llama.cpp was built for a GPU
FLOAT_FILES = ("all F32", "F32", "F16", "BF16")  # GGUF file types whose weights are not quantised  # tokens llama.cpp computes at once inside a decode


INSTALL = ("pip install 'prefixcache[llama]' (llama-cpp-python builds llama.cpp from source; docs/models.md says "
           "how to build it for your CPU or GPU)")


def installed() -> bool:
    """Whether llama-cpp-python can be imported (without importing it)."""
    import importlib.util

    return importlib.util.find_spec("llama_cpp") is not None


def gpu_build() -> bool:
    """Whether the installed llama.cpp can offload layers to a GPU (CUDA, Metal, Vulkan builds)."""
    import llama_cpp

    return bool(llama_cpp.llama_supports_gpu_offload())


def default_threads() -> int:
    """Every core this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


def context_cells(prefix_tokens: int) -> int:
    """The key/value cells a context is made with for a prefix of `prefix_tokens`: the prefix and
    one decode's rows (a longer row makes it larger)."""
    return -(-(prefix_tokens + DECODE_TOKENS) // 256) * 256


def kv_bytes(path: Path) -> int:
    """Bytes a key or value number takes in the context for the GGUF file at `path`: 4 for a
    float32 file (its `general.file_type` 0), else 2 (llama.cpp's float16)."""
    from .memory import gguf_facts

    try:
        return 4 if gguf_facts(path).file_type == 0 else 2
    except Exception:  # noqa: BLE001 - an estimate's input: float16 when the file does not say
        return 2


@dataclass(frozen=True)
class LlamaPrefix:
    """A prefix decoded by the engine: `last_logits` [V] score what follows it, `state` puts it
    back into sequence 0 of the engine's context."""

    ids: tuple[int, ...]
    last_logits: np.ndarray
    prefill_ms: float
    state: bytes = field(default=b"", repr=False)  # llama.cpp's saved sequence: how it is put back


@dataclass
class _Planned:
    """One row laid out for a decode: its own tokens' and trie nodes' indices in the batch."""

    row: Row
    trie: Trie
    seqs: list[int]
    end: int  # batch index of the row's last own token
    nodes: list[int]  # batch index of each trie node


class LlamaEngine:
    """Scores candidates after prompts sharing one prefix, on llama.cpp (see the module's doc).

    Example:
        engine = LlamaEngine("model.Q4_K_M.gguf")
        prefix = engine.prefill(prefix_ids)
        engine.score(prefix, [Row(ids, len(prefix_ids), [(12, 7), (40, 7)])])
    """

    name = "llama.cpp"
    branches = True  # rows kept in their sequences between decodes, trie nodes fed later (model/llamabranches.py)

    def __init__(self, path: str | Path, threads: int | None = None, gpu_layers: int = 0,
                 ubatch: int = DECODE_TOKENS):
        import llama_cpp

        self._L = L = llama_cpp
        _quiet(L)
        L.llama_backend_init()
        params = L.llama_model_default_params()
        params.n_gpu_layers = gpu_layers
        # Read into memory, not mapped: measured on a Q4_K_M file, mapping it kept the file's pages of the
        # weights llama.cpp repacks for its CPU kernels in memory beside the repacked copy (1.74 GB resident
        # for a 1.0 GB file, 1.03 GB read).
        params.load_mode = 0  # LLAMA_LOAD_MODE_NONE
        check_gguf(Path(path))
        self._model = L.llama_model_load_from_file(str(path).encode(), params)
        if not self._model:
            raise ModelError(f"llama.cpp cannot load {path}: not a GGUF file it reads (see its log with "
                             f"PREFIXCACHE_LOG=debug)")
        self.path = Path(path)
        self.vocab = L.llama_vocab_n_tokens(L.llama_model_get_vocab(self._model))
        trained = int(L.llama_model_n_ctx_train(self._model))
        self.max_positions = trained if trained > 0 else None
        self.threads = threads or default_threads()
        # Micro-batch: a whole decode at once where memory allows (the weights are streamed once a
        # decode, not once per 512 tokens): measured on the 135M Q4_1 file, 2 threads, run's batches,
        # 185 against 234 CPU ms/item; 0.5B Q4_K_M 464 against 471.
        self.ubatch = ubatch
        self.device = "gpu" if gpu_layers and L.llama_supports_gpu_offload() else "cpu"
        self.dtype = file_type(self._model, L)
        self.label_tokens = 0
        self.context = 0  # the cells of the context made so far (one is made at the first prefill)
        self._ctx = self._mem = None
        self._resident: LlamaPrefix | None = None  # the prefix sequence 0 holds now
        self._rewound: list[int] = []  # what sequence 0 holds after `one_prompt_at_a_time`
        self._embeddings = False
        self._taken: set[int] = set()  # sequences a group opened for a race holds (`open_items`)

    def _ensure_context(self, cells: int) -> None:
        """A context of at least `cells` key/value cells (the model's trained context at most):
        made anew, larger, when the one there is smaller (its prefix is restored when used)."""
        cells = context_cells(cells - DECODE_TOKENS)
        if self.max_positions:
            cells = min(cells, self.max_positions)
        if self._ctx is not None and cells <= self.context:
            return
        if self._ctx is not None:
            self._L.llama_free(self._ctx)
            self._ctx, self._resident = None, None
        L = self._L
        cp = L.llama_context_default_params()
        cp.n_ctx = cells
        cp.n_batch = cells  # a row as long as the context allows fits one decode
        cp.n_ubatch = min(self.ubatch, cells)
        cp.n_seq_max = MAX_SEQUENCES
        cp.kv_unified = True
        cp.swa_full = True  # sliding-window layers keep every prefix cell: rows must see their window of it
        cp.n_threads = cp.n_threads_batch = self.threads
        cp.no_perf = True
        if self.dtype in FLOAT_FILES:
            # Measured on a float32 file: llama.cpp's CPU flash attention moved log-probs by up to 0.028
            # (it computes in float16), and a row's by 0.028 with its neighbours; without it, and with
            # float32 keys and values, 4e-5 from transformers and 7e-6 between batches (a third slower).
            cp.flash_attn_type = 0  # LLAMA_FLASH_ATTN_TYPE_DISABLED
            if self.dtype in ("all F32", "F32"):
                cp.type_k = cp.type_v = 0  # GGML_TYPE_F32 (else float16)
        self._ctx = L.llama_init_from_model(self._model, cp)
        if not self._ctx:
            raise ModelError(f"llama.cpp cannot make a context of {cells} positions for {self.path.name} "
                             f"(out of memory?)")
        self._mem = L.llama_get_memory(self._ctx)
        self.context = cells
        self._embeddings = False

    @property
    def hidden_size(self) -> int:
        return int(self._L.llama_model_n_embd(self._model))

    naive_ways = ("item", "candidate", "rewound", "first")  # its own one-prompt-at-a-time paths (`naive`)
    weights_bytes = 0  # the file as llama.cpp reads it: not a second copy of anything

    def naive(self, row: Row, way: str) -> list[float]:
        """llama.cpp's own one-prompt-at-a-time path (`one_prompt_at_a_time`): "item" re-encodes
        each row, "candidate" each candidate, "rewound" rewinds to what a prompt shares with the last;
        "first" ranks by each candidate's first token alone (`first_tokens`: cheaper, other numbers)."""
        if way == "first":
            return self.first_tokens(row)
        return self.one_prompt_at_a_time(row, "" if way == "rewound" else way)

    def peak_gflops(self, seconds: float = 1.0) -> float | None:
        """None: its quantised kernels have no float32 matrix peak to compare with."""
        return None

    def synchronize(self) -> None:
        """Nothing: a decode returns when it is done."""

    def linear_params(self) -> tuple[int, int]:
        """(numbers in the layers every token goes through, numbers in the output layer): the
        model's parameters less its embeddings', and the embeddings' (what `bench` counts as work)."""
        total = int(self._L.llama_model_n_params(self._model))
        head = self.vocab * self.hidden_size
        return total - head, head

    def close(self) -> None:
        """Free the context and the model (the engine is unusable after)."""
        if self._ctx:
            self._L.llama_free(self._ctx)
            self._ctx = None
        if self._model:
            self._L.llama_model_free(self._model)
            self._model = None

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # noqa: BLE001 - interpreter teardown
            pass

    # -- the protocol --------------------------------------------------------------------------

    def prefill(self, ids: Sequence[int]) -> LlamaPrefix:
        """Decode the prefix into sequence 0 and keep its state, so that it can be put back after
        another prefix was used (one prefix lives in the context at a time)."""
        if not ids:
            raise ValueError("the prefix is empty")
        if self.max_positions and len(ids) >= self.max_positions:
            raise ModelError(f"the prompt prefix is {len(ids)} tokens, more than the model's context of "
                             f"{self.max_positions}")
        start = time.perf_counter()
        self._ensure_context(len(ids) + DECODE_TOKENS)
        self._L.llama_memory_clear(self._mem, True)
        self._resident = None
        ids = tuple(int(i) for i in ids)
        last = None
        for at in range(0, len(ids), DECODE_TOKENS):
            chunk = ids[at: at + DECODE_TOKENS]
            final = at + len(chunk) == len(ids)
            self.decode([Token(t, at + k, [0], final and k == len(chunk) - 1) for k, t in enumerate(chunk)])
            if final:
                last = self.logits_at(len(chunk) - 1).astype(np.float32)
        if last is None:
            raise ValueError("a prefix needs at least one token")
        self._resident = LlamaPrefix(ids, last, (time.perf_counter() - start) * 1000, self._saved())
        return self._resident

    @property
    def precision(self) -> str:
        """What it computes in: the GGUF file's type as llama.cpp reads it ("Q4_1")."""
        return str(self.dtype)

    def export_prefix(self, prefix: LlamaPrefix) -> tuple[dict[str, np.ndarray], dict[str, str]]:
        """What the prefix store keeps of a prefix: its last logits and the keys and values as
        llama.cpp saves a sequence."""
        return {"logits": prefix.last_logits.copy(), "state": np.frombuffer(prefix.state, np.uint8).copy()}, {}

    def restore_prefix(self, ids: Sequence[int], tensors: dict[str, Any], meta: dict[str, str],
                       load_ms: float) -> LlamaPrefix:
        """A prefix `export_prefix` gave, put back into sequence 0; ValueError when llama.cpp refuses it."""
        state = np.asarray(tensors["state"], dtype=np.uint8).tobytes()
        return self.restore(ids, state, np.asarray(tensors["logits"], dtype=np.float32), load_ms)

    def restore(self, ids: Sequence[int], state: bytes, last_logits: np.ndarray, prefill_ms: float) -> LlamaPrefix:
        """A prefix saved by `state`, put back into sequence 0; ValueError when llama.cpp refuses it."""
        prefix = LlamaPrefix(tuple(int(i) for i in ids), np.asarray(last_logits, np.float32), prefill_ms, bytes(state))
        self._activate(prefix)
        return prefix

    def _saved(self) -> bytes:
        size = self._L.llama_state_seq_get_size(self._ctx, 0)
        buffer = (ctypes.c_uint8 * size)()
        return bytes(buffer[:self._L.llama_state_seq_get_data(self._ctx, buffer, size, 0)])

    def _activate(self, prefix: LlamaPrefix) -> None:
        """`prefix` in sequence 0, put back from its state when another one is there."""
        if prefix is self._resident:
            return
        self._ensure_context(len(prefix.ids) + DECODE_TOKENS)
        self._L.llama_memory_clear(self._mem, True)
        self._resident = None
        buffer = (ctypes.c_uint8 * len(prefix.state)).from_buffer_copy(prefix.state)
        if not self._L.llama_state_seq_set_data(self._ctx, buffer, len(prefix.state), 0):
            raise ValueError("llama.cpp did not accept the saved prefix state")
        if int(self._L.llama_memory_seq_pos_max(self._mem, 0)) != len(prefix.ids) - 1:
            self._L.llama_memory_clear(self._mem, True)
            raise ValueError("the saved prefix state does not hold every prefix position")
        self._resident = prefix

    def score(self, prefix: LlamaPrefix, rows: Sequence[Row]) -> list[list[float]]:
        """Summed log-probabilities, one list per row, one float per candidate (in order)."""
        return self._score(prefix, rows, None)[0]

    layers = 0  # llama.cpp's API gives the output norm's state at a decoded output, no other layer's

    def score_with_states(self, prefix: LlamaPrefix, rows: Sequence[Row], wanted: Sequence[Sequence[int]],
                          probe: Probe | None = None) -> tuple[list[list[float]], list[np.ndarray]]:
        """`score`, and per row the final hidden state (the output norm's, what the output layer
        reads) where each candidate in `wanted[b]` has its first token scored from. Middle layers
        and means (`probe`) are not offered: its API exposes no other layer, and a mean would need
        an output (the vocabulary's logits) at every token of the item."""
        if probe is not None and not probe.plain:
            raise ValueError("the llama.cpp engine reads the final state at answer positions only (layers = 0)")
        return self._score(prefix, rows, wanted)

    def one_prompt_at_a_time(self, row: Row, fresh: str = "") -> list[float]:
        """llama.cpp's own way of scoring, for `bench` to time against: each candidate a prompt of
        its own (the row's ids and the candidate) decoded in sequence 0, which is rewound to the
        longest start it shares with the prompt before (llama-cpp-python's `Llama.eval`), the
        last shared token decoded again for its logits. `fresh`: "item" starts each row from
        nothing (a full re-encode per item), "candidate" each candidate."""
        ids, out = self._sequence_zero(row, clear=fresh == "item"), []
        for i, cand in enumerate(row.candidates):
            if fresh == "candidate":
                self._L.llama_memory_clear(self._mem, True)
                self._rewound = []
            prompt = ids + [int(t) for t in cand]
            keep = self._rewind(prompt, len(ids) + row.skip(i) - 1)
            first = len(ids) + row.skip(i) - 1  # the logits scoring the candidate's first scored token
            self.decode([Token(t, keep + k, [0], keep + k >= first) for k, t in enumerate(prompt[keep:-1])])
            out.append(sum(float(self.logits_at(at - keep)[prompt[at + 1]]) - self.logsumexp_at(at - keep)
                           for at in range(first, len(prompt) - 1)))
            self._rewound = prompt[:-1]
        return out

    def first_tokens(self, row: Row) -> list[float]:
        """llama.cpp's cheapest way to rank candidates, for `bench` to time against: the prompt
        decoded once in sequence 0 (rewound to what it shares with the prompt before), each
        candidate scored by the log-probability of its first token alone. Not the same numbers as
        `score` (which scores every token of a candidate): another, cheaper piece of work."""
        if row.skips and any(row.skips):
            raise ValueError("first-token ranking reads no question's text before its options")
        ids = self._sequence_zero(row, clear=False)
        keep = self._rewind(ids, len(ids) - 1)
        self.decode([Token(t, keep + k, [0], keep + k == len(ids) - 1) for k, t in enumerate(ids[keep:])])
        last = len(ids) - 1 - keep
        logits, total = self.logits_at(last), self.logsumexp_at(last)
        self._rewound = ids
        return [float(logits[int(c[0])]) - total for c in row.candidates]

    def _sequence_zero(self, row: Row, clear: bool) -> list[int]:
        """Sequence 0 ready for one prompt at a time (a prefix put back there by `score` taken
        out, or everything where `clear`); the row's ids."""
        if self._ctx is None:
            self._ensure_context(len(row.ids) + DECODE_TOKENS)
        if self._resident is not None or clear:
            self._L.llama_memory_clear(self._mem, True)
            self._resident, self._rewound = None, []
        return [int(i) for i in row.ids]

    def _rewind(self, prompt: list[int], most: int) -> int:
        """Sequence 0 rewound to the start `prompt` shares with what it holds (at most `most`
        tokens); returns how many tokens it keeps."""
        keep = min(_shared(prompt, self._rewound), most)
        self._L.llama_memory_seq_rm(self._mem, 0, keep, -1)
        self._ensure_fits(len(prompt))
        return keep

    def _ensure_fits(self, cells: int) -> None:
        if cells > self.context:
            raise ModelError(f"a prompt of {cells} tokens does not fit the llama.cpp context of {self.context}")

    # -- scoring -------------------------------------------------------------------------------

    def open_items(self, prefix: LlamaPrefix, rows: Sequence[Row]) -> Iterator[LlamaOpenItems]:
        """The rows in groups, each decoded once and kept for a race to feed its trie nodes
        (model/llamabranches.py): every node of a group's tries fits its cells, and a group holds
        as many rows as the sequences allow at what a row of the last group took (the first one:
        one a leaf, as `score`): the groups, and so the decodes' shapes, follow from the rows alone,
        so that a quantised file's race gives a batch the same numbers in every run (a resumed one
        too). A group's cells are freed when the next one opens or the iterator is closed. One
        group is open at a time: scoring anything else in between frees it."""
        from .llamabranches import LlamaOpenItems

        tries = [trie(r.candidates) for r in rows]
        self._check(prefix, rows, tries)
        self._set_embeddings(False)
        start, most = 0, None
        while start < len(rows):  # each group sized when it opens, by what a row of the last one took
            group = [start + b for b in next(self._groups(rows[start:], tries[start:], most))]
            start = group[-1] + 1
            opened = None
            try:
                opened = LlamaOpenItems(self, [rows[b] for b in group], [tries[b] for b in group], MAX_SEQUENCES)
                yield opened
            finally:
                self.free_sequences(sorted(self._taken))
                if opened is not None:
                    most = max(1, opened.most)

    def take_sequence(self, seq: int, shared: int) -> None:
        """Sequence `seq` given the prefix's first `shared` cells (a tag on them, no copy), held
        until `free_sequences`."""
        self._taken.add(seq)
        self._L.llama_memory_seq_cp(self._mem, 0, seq, 0, shared)

    def tag_cells(self, source: int, seq: int, start: int, end: int) -> None:
        """The cells `source` holds at positions [start, end) seen by sequence `seq` too (no copy)."""
        self._L.llama_memory_seq_cp(self._mem, source, seq, start, end)

    def free_sequences(self, seqs: Sequence[int]) -> None:
        """Sequences `seqs` removed from the context: cells no other sequence holds are free."""
        for s in seqs:
            self._L.llama_memory_seq_rm(self._mem, s, -1, -1)
            self._taken.discard(s)

    def _score(self, prefix: LlamaPrefix, rows: Sequence[Row], wanted: Sequence[Sequence[int]] | None
               ) -> tuple[list[list[float]], list[np.ndarray]]:
        tries = [trie(r.candidates) for r in rows]  # each row's, built once for the checks, groups and plan
        self._check(prefix, rows, tries)
        self._set_embeddings(wanted is not None)
        results: list[list[float]] = [[] for _ in rows]
        states: list[np.ndarray] = [np.zeros((0, self.hidden_size), np.float32) for _ in rows]
        for group in self._groups(rows, tries):
            planned, tokens = self._plan([rows[b] for b in group], [tries[b] for b in group])
            self.label_tokens += sum(len(p.nodes) for p in planned)
            try:
                self.decode(tokens)
                for b, p in zip(group, planned):
                    results[b] = self._row_logprobs(p)
                    if wanted is not None:
                        states[b] = self._row_states(p, wanted[b])
            finally:
                for s in {s for p in planned for s in p.seqs}:
                    self._L.llama_memory_seq_rm(self._mem, s, -1, -1)
        return results, states

    def _check(self, prefix: LlamaPrefix, rows: Sequence[Row], tries: Sequence[Trie]) -> None:
        self.free_sequences(sorted(self._taken))  # a group opened for a race and left: its rows would be seen
        self._activate(prefix)
        P = len(prefix.ids)
        for r, t in zip(rows, tries):
            if (not 0 <= r.prefix_len <= P or r.prefix_len >= len(r.ids)
                    or any(len(c) <= r.skip(i) for i, c in enumerate(r.candidates))):
                raise ValueError("each row needs a prefix_len <= the prefix, own ids, and candidates with ids to score")
            if tuple(r.ids[:r.prefix_len]) != prefix.ids[:r.prefix_len]:
                raise ValueError("a row's leading ids are not the prefix's")
            cells = _length(r, t)
            if r.prefix_len + cells > self.context:
                if self.max_positions and r.prefix_len + cells > self.max_positions:
                    raise ModelError(f"an item with its candidates takes {r.prefix_len + cells} positions, "
                                     f"more than the model's context of {self.max_positions}")
                self._ensure_context(P + cells)
                self._activate(prefix)

    def _groups(self, rows: Sequence[Row], tries: Sequence[Trie], most: int | None = None) -> Iterator[list[int]]:
        """Rows in order, in groups one decode holds (sequences, tokens and free cells). `most`:
        the sequences a row is counted for at most, not one a leaf of its trie (a race's rows take
        sequences as they branch, model/llamabranches.py: sized by what the last race's took)."""
        assert self._resident is not None  # groups are made for rows after the prefix
        budget = min(DECODE_TOKENS, self.context - len(self._resident.ids))
        group: list[int] = []
        seqs = tokens = 0
        for b, (row, t) in enumerate(zip(rows, tries)):
            n, s = _length(row, t), max(1, len(_leaf_nodes(t)))
            if s >= MAX_SEQUENCES:
                raise ModelError(f"an item's candidates need {s} llama.cpp sequences, more than its "
                                 f"{MAX_SEQUENCES - 1}: use fewer labels or options an item")
            s = min(s, most) if most else s
            if group and (seqs + s >= MAX_SEQUENCES or tokens + n > budget):
                yield group
                group, seqs, tokens = [], 0, 0
            group.append(b)
            seqs, tokens = seqs + s, tokens + n
        if group:
            yield group

    def _plan(self, rows: Sequence[Row], tries: Sequence[Trie]) -> tuple[list[_Planned], list[Token]]:
        """The decode's tokens: each row's own tokens carrying all its sequences, then its trie
        nodes carrying the sequences of the leaves below them; logits where a token is scored."""
        tokens: list[Token] = []
        planned, next_seq = [], 1
        for row, t in zip(rows, tries):
            leaves = _leaf_nodes(t)
            seqs = list(range(next_seq, next_seq + max(1, len(leaves))))
            next_seq += len(seqs)
            for s in seqs:  # the prefix cells this row shares, tagged with its sequences (no copy)
                self._L.llama_memory_seq_cp(self._mem, 0, s, 0, row.prefix_len)
            own = [int(i) for i in row.ids[row.prefix_len:]]
            start = len(tokens)
            tokens += [Token(tok, row.prefix_len + k, seqs, False) for k, tok in enumerate(own)]
            end = start + len(own) - 1
            node_seqs = _node_sequences(t, leaves, seqs)
            nodes = []
            for k, tok in enumerate(t.tokens):
                nodes.append(len(tokens))
                tokens.append(Token(tok, row.prefix_len + len(own) + t.depths[k] - 1, node_seqs[k], False))
            p = _Planned(row, t, seqs, end, nodes)
            for at in _scored_at(p):
                tokens[at].logits = True
            planned.append(p)
        return planned, tokens

    def _row_logprobs(self, p: _Planned) -> list[float]:
        out, lse = [], {}
        for i, cand in enumerate(p.row.candidates):
            total = 0.0
            for k in range(p.row.skip(i), len(cand)):
                at = p.end if k == 0 else p.nodes[p.trie.paths[i][k - 1]]
                if at not in lse:
                    lse[at] = self.logsumexp_at(at)
                total += float(self.logits_at(at)[cand[k]]) - lse[at]
            out.append(total)
        return out

    def _row_states(self, p: _Planned, wanted: Sequence[int]) -> np.ndarray:
        width = self.hidden_size
        picked = []
        for i in wanted:
            skip = p.row.skip(i)
            at = p.end if skip == 0 else p.nodes[p.trie.paths[i][skip - 1]]
            ptr = self._L.llama_get_embeddings_ith(self._ctx, at)
            picked.append(np.ctypeslib.as_array(ptr, shape=(width,)).astype(np.float32))
        return np.stack(picked) if picked else np.zeros((0, width), np.float32)

    # -- llama.cpp calls -----------------------------------------------------------------------

    def _set_embeddings(self, on: bool) -> None:
        if on != self._embeddings:
            self._L.llama_set_embeddings(self._ctx, on)
            self._embeddings = on

    def decode(self, tokens: Sequence[Token]) -> None:
        """Decode one batch of tokens into the context's cells (ModelError when llama.cpp refuses
        it): what the engine's passes and its kept branches (llamabranches.py) run."""
        L = self._L
        width = max(len(t.seqs) for t in tokens)
        batch = L.llama_batch_init(len(tokens), 0, width)
        try:
            batch.n_tokens = len(tokens)
            for i, t in enumerate(tokens):
                batch.token[i], batch.pos[i], batch.n_seq_id[i], batch.logits[i] = t.id, t.pos, len(t.seqs), t.logits
                for j, s in enumerate(t.seqs):
                    batch.seq_id[i][j] = s
            rc = L.llama_decode(self._ctx, batch)
        finally:
            L.llama_batch_free(batch)
        if rc != 0:
            raise ModelError(f"llama.cpp could not decode a batch of {len(tokens)} tokens (code {rc}): "
                             f"{'no free key/value cells' if rc == 1 else 'see its log with PREFIXCACHE_LOG=debug'}")

    def logits_at(self, at: int) -> np.ndarray:
        """The last decode's logits [V] at its `at`-th token whose logits were kept (a view)."""
        ptr = self._L.llama_get_logits_ith(self._ctx, at)
        return np.ctypeslib.as_array(ptr, shape=(self.vocab,))

    def logsumexp_at(self, at: int) -> float:
        """log sum exp of `logits_at(at)`: what turns a logit into a log-probability."""
        a = self.logits_at(at).astype(np.float64)
        m = float(a.max())
        return m + math.log(float(np.exp(a - m).sum()))


def _shared(a: Sequence[int], b: Sequence[int]) -> int:
    """How many leading ids `a` and `b` share."""
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def _length(row: Row, t: Trie) -> int:
    """The cells a row takes in a decode: its own tokens and its trie's (`t`) nodes."""
    return len(row.ids) - row.prefix_len + len(t)


def _leaf_nodes(t: Trie) -> list[int]:
    """The trie's nodes no other node continues."""
    parents = set(t.parents)
    return [k for k in range(len(t)) if k not in parents]


def _node_sequences(t: Trie, leaves: list[int], seqs: list[int]) -> list[list[int]]:
    """Per node, the sequences of the leaves below it (a leaf's own, added up to the root)."""
    below: list[list[int]] = [[] for _ in range(len(t))]
    for leaf, s in zip(leaves, seqs):
        node = leaf
        while node >= 0:
            below[node].append(s)
            node = t.parents[node]
    return below


def _scored_at(p: _Planned) -> set[int]:
    """Batch indices whose logits score some candidate token (a bare row: its end's)."""
    at = set() if p.row.candidates else {p.end}
    for i, cand in enumerate(p.row.candidates):
        for k in range(p.row.skip(i), len(cand)):
            at.add(p.end if k == 0 else p.nodes[p.trie.paths[i][k - 1]])
    return at


def file_type(model: Any, L: Any) -> str:
    """The GGUF file's type as llama.cpp names it ("Q4_K - Medium", "F32"): its `general.file_type`."""
    desc = ctypes.create_string_buffer(256)
    L.llama_model_desc(model, desc, len(desc))
    words = desc.value.decode(errors="replace").split()  # "<architecture> <size> <file type>"
    return " ".join(words[2:]) or "gguf"


_QUIET = None


def _quiet(L: Any) -> None:
    """llama.cpp's own log goes to this program's log (debug), not to stderr."""
    global _QUIET
    if _QUIET is not None:
        return

    def forward(level: int, text: bytes, user_data: Any) -> None:
        if log.isEnabledFor(logging.DEBUG):
            log.debug("llama.cpp: %s", text.decode(errors="replace").rstrip())

    _QUIET = L.llama_log_callback(forward)
    L.llama_log_set(_QUIET, ctypes.c_void_p(0))
