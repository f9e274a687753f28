"""A question whose stem lists many described options is tokenised once, not once an option:
each answer's ids equal those of the whole stem and answer encoded together (the reference),
for chat and plain prompts, and the characters handed to the tokenizer grow with the pack's
size, not with its square."""

from __future__ import annotations

import pytest
from helpers import make_spec

from prefixcache.model.rows import trie
from prefixcache.task.prompt import PromptBuilder


def _pack(options: int, questions: int = 2) -> dict:
    return {f"q{j}": {"type": "choice", "instructions": f"Which topic ({j})?",
                      "criteria": {f"option {i}": f"tickets about topic {i} and its matters" for i in range(options)}}
            for j in range(questions)}


class Counting:
    """A tokenizer that counts the characters it is asked to encode."""

    def __init__(self, tok):
        self.tok, self.chars = tok, 0

    def __call__(self, text, **kwargs):
        self.chars += len(text)
        return self.tok(text, **kwargs)

    def __getattr__(self, name):
        return getattr(self.tok, name)


@pytest.mark.parametrize("fixture", ["chat_tokenizer", "plain_tokenizer"])
def test_each_answer_is_what_encoding_the_whole_stem_and_answer_gives(tmp_path, request, fixture):
    tok = request.getfixturevalue(fixture)
    spec = make_spec(tmp_path, system="Sort tickets.", questions=_pack(40))
    builder = PromptBuilder(spec, tok)
    for q in spec.questions:
        for text in q.texts:
            reference = builder.candidate_ids(builder.branch_text(q.branch(), text), whole=True)
            assert builder.candidates[f"{q.id}\x1f{text}"] == reference


def test_tokenising_a_pack_grows_with_its_size_not_its_square(tmp_path, chat_tokenizer):
    def chars(options: int) -> int:
        counting = Counting(chat_tokenizer)
        PromptBuilder(make_spec(tmp_path, system="Sort tickets.", questions=_pack(options)), counting)
        return counting.chars

    small, large = chars(50), chars(200)
    assert large < 6 * small  # 4x the options: ~4x the characters (16x when each answer re-encodes its stem)


def _reference_trie(candidates):
    child, tokens, parents, depths, paths = {}, [], [], [], []
    for cand in candidates:
        path, node = [], -1
        for depth, tok in enumerate(cand[:-1], start=1):
            if (node, tok) not in child:
                child[node, tok] = len(tokens)
                tokens.append(tok), parents.append(node), depths.append(depth)
            node = child[node, tok]
            path.append(node)
        paths.append(path)
    return tokens, parents, depths, paths


def test_the_trie_of_candidates_sharing_long_stems_is_the_plain_walks():
    import random

    rng = random.Random(0)
    stems = [tuple(rng.randrange(50) for _ in range(rng.randrange(1, 300))) for _ in range(5)]
    candidates = [stem + tuple(rng.randrange(50) for _ in range(rng.randrange(1, 4)))
                  for stem in stems for _ in range(30)] + [(1,), (1, 2), (2, 3, 4)]
    rng.shuffle(candidates)
    for order in (candidates, sorted(candidates)):
        built = trie(order)
        assert (built.tokens, built.parents, built.depths, built.paths) == _reference_trie(order)
