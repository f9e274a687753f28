"""The llama.cpp engine against llama.cpp's own full forward of each prompt, against the
transformers engine on the same GGUF file, and against itself in other batches; a quantised copy
against the float32 file; its prefix kept in the prefix store."""

from __future__ import annotations

import math

import numpy as np
import pytest

llama_cpp = pytest.importorskip("llama_cpp")

from gguf_fixture import quantize  # noqa: E402

from prefixcache.model.engine import Engine  # noqa: E402
from prefixcache.model.llamacpp import LlamaEngine  # noqa: E402
from prefixcache.model.load import load_model, load_tokenizer, resolve_model  # noqa: E402
from prefixcache.model.rows import Row  # noqa: E402
from prefixcache.model.store import PrefixStore  # noqa: E402

pytestmark = pytest.mark.slow  # the quick tier (-m "not slow and not e2e") leaves it out


@pytest.fixture(scope="module")
def engine(gguf_file):
    return LlamaEngine(gguf_file, threads=1)


@pytest.fixture(scope="module")
def tokenizer(gguf_file, gguf_parsed):
    return load_tokenizer(resolve_model(str(gguf_file)), gguf_parsed)


TEXTS = ["I was charged twice for my subscription, please refund it.",
         "The app crashes when I open a project.",
         "I forgot my password and cannot sign in.",
         "Where is my invoice for March?"]
LABELS = [" billing", " technical problem", " account access", " bill", " technical"]


def rows_for(tokenizer, texts=TEXTS, labels=LABELS):
    """Rows sharing a prefix: the prompt's ids up to each text, the labels' ids as candidates."""
    prefix = tokenizer("You route support tickets. Ticket:")["input_ids"]
    cands = [tuple(tokenizer(label, add_special_tokens=False)["input_ids"]) for label in labels]
    rows = [Row(prefix + tokenizer(" " + t + " Label:", add_special_tokens=False)["input_ids"], len(prefix), cands)
            for t in texts]
    return prefix, rows


def fresh_decode(path, seq, outputs, embeddings=False):
    """llama.cpp's own decode of `seq` at once in a fresh context (as the engine runs a float32
    file), logits (or with `embeddings` the final states) asked where `outputs(i)` is true; the
    model, context and batch, for `free` once read."""
    model = llama_cpp.llama_model_load_from_file(str(path).encode(), llama_cpp.llama_model_default_params())
    params = llama_cpp.llama_context_default_params()
    params.n_ctx, params.n_batch, params.n_threads, params.n_threads_batch = 512, 512, 1, 1
    params.flash_attn_type, params.type_k, params.type_v = 0, 0, 0  # as the engine runs a float32 file
    if embeddings:
        params.embeddings, params.pooling_type = True, 0  # LLAMA_POOLING_TYPE_NONE: one state a token
    ctx = llama_cpp.llama_init_from_model(model, params)
    batch = llama_cpp.llama_batch_init(len(seq), 0, 1)
    batch.n_tokens = len(seq)
    for i, tok in enumerate(seq):
        batch.token[i], batch.pos[i], batch.n_seq_id[i], batch.logits[i] = tok, i, 1, outputs(i)
        batch.seq_id[i][0] = 0
    assert llama_cpp.llama_decode(ctx, batch) == 0
    return model, ctx, batch


def free(model, ctx, batch):
    llama_cpp.llama_batch_free(batch)
    llama_cpp.llama_free(ctx)
    llama_cpp.llama_model_free(model)


def full_forward(path, ids, candidate):
    """llama.cpp's own scoring of one prompt and candidate, nothing cached: the whole sequence
    decoded at once in a fresh context, each candidate token's log-probability from the logits
    before it."""
    model, ctx, batch = fresh_decode(path, list(ids) + list(candidate), lambda i: i >= len(ids) - 1)
    vocab = llama_cpp.llama_vocab_n_tokens(llama_cpp.llama_model_get_vocab(model))
    total = 0.0
    for k, tok in enumerate(candidate):
        logits = np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(ctx, len(ids) - 1 + k), shape=(vocab,))
        logits = logits.astype(np.float64)
        total += logits[tok] - logits.max() - math.log(np.exp(logits - logits.max()).sum())
    free(model, ctx, batch)
    return total


def test_every_candidate_equals_llama_cpps_full_forward(gguf_file, engine, tokenizer):
    prefix, rows = rows_for(tokenizer)
    got = engine.score(engine.prefill(prefix), rows)
    worst = max(abs(got[b][i] - full_forward(gguf_file, row.ids, cand))
                for b, row in enumerate(rows[:2]) for i, cand in enumerate(row.candidates))
    assert worst < 1e-4, worst


def test_equals_the_transformers_engine_on_the_same_file(gguf_file, engine, tokenizer, tmp_path):
    import torch

    source = resolve_model(str(gguf_file))
    reference = Engine(load_model(source, tokenizer, tmp_path, "cpu", torch.float32))
    prefix, rows = rows_for(tokenizer)
    want = reference.score(reference.prefill(prefix), rows)
    got = engine.score(engine.prefill(prefix), rows)
    assert np.abs(np.array(got) - np.array(want)).max() < 1e-3
    # the hidden state a fitted head reads, at each candidate's answer position
    scores, states = engine.score_with_states(engine.prefill(prefix), rows[:2], [[0, 2], [1]])
    _, expected = reference.score_with_states(reference.prefill(prefix), rows[:2], [[0, 2], [1]])
    assert np.abs(np.array(scores) - np.array(want[:2])).max() < 1e-3  # the scores with them are the same
    assert [s.shape for s in states] == [(2, engine.hidden_size), (1, engine.hidden_size)]
    assert max(np.abs(a - b).max() for a, b in zip(states, expected, strict=True)) < 1e-3


def test_a_rows_numbers_do_not_depend_on_its_neighbours(engine, tokenizer):
    prefix, rows = rows_for(tokenizer)
    handle = engine.prefill(prefix)
    together = engine.score(handle, rows)
    alone = [engine.score(handle, [row])[0] for row in rows]
    reversed_ = engine.score(handle, rows[::-1])[::-1]
    assert np.abs(np.array(together) - np.array(alone)).max() < 1e-4  # measured: 7e-6
    assert np.abs(np.array(together) - np.array(reversed_)).max() < 1e-4


def own_final_state(path, ids):
    """llama.cpp's own final state (what its output layer reads) after the last of `ids`: the whole
    sequence decoded at once in a fresh context asked for embeddings, no pooling."""
    model, ctx, batch = fresh_decode(path, list(ids), lambda i: i == len(ids) - 1, embeddings=True)
    width = llama_cpp.llama_model_n_embd(model)
    state = np.ctypeslib.as_array(llama_cpp.llama_get_embeddings_ith(ctx, len(ids) - 1), shape=(width,)).copy()
    free(model, ctx, batch)
    return state


def test_the_state_a_head_reads_equals_llama_cpps_own_forward(gguf_file, engine, tokenizer):
    prefix, rows = rows_for(tokenizer)
    _, states = engine.score_with_states(engine.prefill(prefix), rows[:2], [[0], [0]])
    for row, state in zip(rows[:2], states, strict=True):
        want = own_final_state(gguf_file, list(row.ids))  # every label's first token is scored from here
        assert np.abs(state[0] - want).max() < 1e-4


def test_a_batch_split_into_several_decodes_equals_each_row_alone(engine, tokenizer):
    """60 rows of 5 labels need 300 sequences, more than one decode holds (255): the batch is split,
    and every row's numbers are those it has alone."""
    texts = [f"{t} (ticket {n})" for n in range(15) for t in TEXTS]
    prefix, rows = rows_for(tokenizer, texts)
    assert sum(len(r.candidates) for r in rows) > 255
    handle = engine.prefill(prefix)
    together = engine.score(handle, rows)
    alone = [engine.score(handle, [row])[0] for row in rows[::7]]
    assert np.abs(np.array(together[::7]) - np.array(alone)).max() < 1e-4
    _, states = engine.score_with_states(handle, rows, [[0]] * len(rows))
    _, one = engine.score_with_states(handle, rows[-1:], [[0]])
    assert len(states) == len(rows) and np.abs(states[-1] - one[0]).max() < 1e-4


def test_typed_question_rows_score_only_after_their_context(engine, tokenizer):
    """A candidate's leading context ids are read, not scored: its log-prob is the full forward's
    minus the context's."""
    prefix, rows = rows_for(tokenizer)
    question = tuple(tokenizer(" Is it urgent? Answer:", add_special_tokens=False)["input_ids"])
    options = [question + tuple(tokenizer(o, add_special_tokens=False)["input_ids"]) for o in (" yes", " no")]
    row = Row(rows[0].ids, rows[0].prefix_len, options, [len(question)] * 2)
    got = engine.score(engine.prefill(prefix), [row])[0]
    plain = engine.score(engine.prefill(prefix), [Row(list(rows[0].ids) + list(question), rows[0].prefix_len,
                                                      [o[len(question):] for o in options])])[0]
    assert np.abs(np.array(got) - np.array(plain)).max() < 1e-4


def test_two_prefixes_on_one_engine_are_each_put_back(engine, tokenizer):
    first, rows = rows_for(tokenizer)
    second = tokenizer("Classify this message. Message:")["input_ids"]
    other = [Row(second + list(r.ids[r.prefix_len:]), len(second), r.candidates) for r in rows]
    a = engine.prefill(first)
    want = engine.score(a, rows)
    b = engine.prefill(second)
    want_b = engine.score(b, other)
    assert engine.score(a, rows) == want and engine.score(b, other) == want_b


def test_the_prefix_store_keeps_a_llama_cpp_prefix(engine, tokenizer, tmp_path):
    prefix, rows = rows_for(tokenizer)
    computed = engine.prefill(prefix)
    want = engine.score(computed, rows)
    store = PrefixStore(tmp_path / "store")
    store.save("k", computed, "tiny", engine)
    loaded = store.load("k", engine)
    assert loaded is not None and loaded.ids == computed.ids
    assert engine.score(loaded, rows) == want
    path = next((tmp_path / "store").glob("*.safetensors"))
    data = bytearray(path.read_bytes())
    data[-10] ^= 0xFF  # a flipped byte in the state: refused, removed, computed again by the caller
    path.write_bytes(bytes(data))
    assert store.load("k", engine) is None and not path.exists()


def test_a_quantised_copy_scores_near_the_float32_file(gguf_file, tokenizer, tmp_path):
    """Q8_0 (llama.cpp's quantizer) against the float32 file it was made from."""
    q8 = LlamaEngine(quantize(gguf_file, tmp_path / "tiny-Q8_0.gguf", "Q8_0"), threads=1)
    f32 = LlamaEngine(gguf_file, threads=1)
    prefix, rows = rows_for(tokenizer)
    got, want = np.array(q8.score(q8.prefill(prefix), rows)), np.array(f32.score(f32.prefill(prefix), rows))
    assert q8.dtype == "Q8_0" and f32.dtype == "all F32"
    relative = np.abs(got - want) / np.abs(want)
    assert relative.max() < 0.05, relative.max()  # measured: 0.020 on these random weights
    assert (got.argmax(1) == want.argmax(1)).all()


def test_a_row_too_long_for_the_model_is_a_model_error(engine, tokenizer):
    from prefixcache.errors import ModelError

    prefix, rows = rows_for(tokenizer)
    long = Row(list(rows[0].ids) + [100] * 2100, rows[0].prefix_len, rows[0].candidates)
    with pytest.raises(ModelError, match="context of 2048"):
        engine.score(engine.prefill(prefix), [long])


def test_the_file_type_and_limits_are_the_files(engine):
    assert (engine.name, engine.device, engine.max_positions, engine.hidden_size) == ("llama.cpp", "cpu", 2048, 64)
    assert engine.branches is True


def race_rows(gguf_file, tokenizer):
    """A fresh engine (no race before: its first group counts a sequence a leaf), its prefix, 12
    rows of 22 leaves each, per row every trie node's summed log-prob by full scoring, and the
    nodes a race feeds to finish each candidate."""
    engine = LlamaEngine(gguf_file, threads=1)
    prefix, rows = rows_for(tokenizer, TEXTS * 3)
    cands = list(rows[0].candidates) + [(300 + i, 500 + i, 700) for i in range(20)]  # 22 leaves a row
    rows = [Row(r.ids, r.prefix_len, cands) for r in rows]
    handle = engine.prefill(prefix)
    nodes = sorted({c[:k] for c in cands for k in range(1, len(c) + 1)})
    summed = [dict(zip(nodes, lps, strict=True)) for lps in engine.score(handle, [Row(r.ids, r.prefix_len, nodes) for r in rows])]
    return engine, handle, rows, summed, sorted({c[:-1] for c in cands if len(c) > 1})


def test_items_kept_between_decodes_feed_branches_as_full_scoring_scores_them(gguf_file, tokenizer):
    """The race's passes on llama.cpp (model/llamabranches.py): rows decoded once, trie nodes fed
    over several decodes, each node's token log-prob that of full scoring; nothing kept after."""
    import random

    engine, handle, rows, summed, ends = race_rows(gguf_file, tokenizer)
    nodes = list(summed[0])
    rng, b0, groups = random.Random(0), 0, 0
    for opened in engine.open_items(handle, rows):
        groups += 1
        for b in range(len(opened.rows)):  # the first tokens come with the rows
            assert all(abs(v - summed[b0 + b][node]) < 1e-4 for node, v in opened.firsts(b).items())
        fed: list[set] = [set() for _ in opened.rows]
        for step in range(3):
            chosen = {b: rng.sample(ends, rng.randint(1, len(ends))) for b in range(len(opened.rows)) if b != step}
            new = sum(len({n[:k] for n in ns for k in range(1, len(n) + 1)} - fed[b]) for b, ns in chosen.items())
            before = engine.label_tokens
            got = opened.feed(chosen)
            assert engine.label_tokens - before >= new  # more only where sequences ran short (next test)
            for b, ns in chosen.items():
                fed[b] |= {n[:k] for n in ns for k in range(1, len(n) + 1)}
            for b, found in got.items():
                for child, value in found.items():  # a token's log-prob: the difference of full scoring's sums
                    want = summed[b0 + b][child] - summed[b0 + b].get(child[:-1], 0.0)
                    assert abs(value - want) < 1e-4, (b, child)
        with pytest.raises(ValueError, match="not a node"):
            opened.feed({0: [(1, 2, 3)]})
        b0 += len(opened.rows)
    assert b0 == len(rows) and groups == 2  # 11 rows of 22 leaves, then one
    again = [dict(zip(nodes, lps, strict=True)) for lps in engine.score(handle, [Row(r.ids, r.prefix_len, nodes) for r in rows])]
    assert again == summed  # nothing the race kept is seen after it


def test_a_race_short_of_sequences_lets_rows_go_and_decodes_them_again(gguf_file, tokenizer):
    """12 rows of 22 leaves in one group (sized by a group before whose rows took one sequence):
    every branch of every row needs 264 sequences of a context's 255. A feed then decodes what
    fits, lets rows go (those not asked for first) and decodes the rest; a row let go is decoded
    again (its own tokens and fed nodes) when next fed. Every value is still full scoring's; no
    node runs twice while the sequences last."""
    engine, handle, rows, summed, ends = race_rows(gguf_file, tokenizer)
    groups = engine.open_items(handle, rows[:11] + rows)
    assert len(next(groups).rows) == 11  # a sequence a leaf; a race that branches nowhere in it: a row took one
    opened = next(groups)  # so the next group holds all 12 (its cells are freed when the iterator goes on)
    assert len(opened.rows) == 12
    costs = []
    for chosen in ({0: ends[:-1], **{b: ends for b in range(1, 12)}},  # rows 0-10 fit the 243 free, row 11 does
                   # not: a second decode for it, row 0 (not asked for any more) let go
                   {0: ends}):  # row 0 decoded again, its own tokens and the 20 branches fed before
        new = sum(len({n[:k] for n in ns for k in range(1, len(n) + 1)}) for b, ns in chosen.items())
        before = engine.label_tokens
        got = opened.feed(chosen)
        costs.append(engine.label_tokens - before - (0 if costs else new))
        assert {b for b in got} == set(chosen)
        for b, found in got.items():
            for child, value in found.items():
                assert abs(value - (summed[b][child] - summed[b].get(child[:-1], 0.0))) < 1e-4, (b, child)
    assert costs[0] == 0 and costs[1] > 20  # row 0's nodes fed before went through the model again
    assert next(groups, None) is None


def test_a_build_that_crashes_on_this_cpu_stops_in_one_line(gguf_file, tmp_path, monkeypatch):
    from prefixcache.errors import ModelError
    from prefixcache.model import llamaprobe

    llamaprobe.probe(gguf_file, tmp_path / "marks")  # this build decodes: marked, not probed again
    assert len(list((tmp_path / "marks").iterdir())) == 1
    monkeypatch.setattr(llamaprobe, "PROBE", "import os; os.abort()")  # what a crashing kernel does to the child
    llamaprobe.probe(gguf_file, tmp_path / "marks")  # the mark holds
    with pytest.raises(ModelError, match=r"llama.cpp crashed decoding tiny-F32.gguf on this CPU \(exit -6\).*"
                                         r"CMAKE_ARGS=\"-DGGML_NATIVE=OFF"):
        llamaprobe.probe(gguf_file, tmp_path / "other-marks")
