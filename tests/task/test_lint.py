"""Label-set lint."""

from __future__ import annotations

import pytest
from conftest import build_tokenizer
from helpers import make_spec

from prefixcache.errors import SpecError
from prefixcache.task.lint import lint_labels
from prefixcache.task.prompt import PromptBuilder

NO_END_CHAT = (
    "{% for m in messages %}{{ m['role'] + ': ' + m['content'] + '\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ 'assistant:\n' }}{% endif %}"
)


def test_prefix_and_shared_first_token_are_warnings_with_an_end_token(chat_tokenizer, tmp_path):
    b = PromptBuilder(make_spec(tmp_path, labels=["tech", "technical", "billing"]), chat_tokenizer)
    warnings = lint_labels(b)
    assert any("'tech' (t|ech) is a token-prefix of 'technical' (t|ech|nic|al)" in w and "<|im_end|>" in w
               for w in warnings)
    assert any("share their first token" in w and "'tech', 'technical'" in w for w in warnings)


def test_prefix_without_end_token_is_fatal_with_sum(tmp_path):
    tok = build_tokenizer(NO_END_CHAT)
    b = PromptBuilder(make_spec(tmp_path, labels=["tech", "technical"]), tok)
    assert b.end_of_answer == ""
    with pytest.raises(SpecError, match="'tech' .* is a token-prefix of 'technical'"):
        lint_labels(b)
    b = PromptBuilder(make_spec(tmp_path, labels=["tech", "technical"], normalize="mean"), tok)
    assert any("compare with care" in w for w in lint_labels(b))


def test_unequal_lengths(chat_tokenizer, tmp_path):
    b = PromptBuilder(make_spec(tmp_path, labels=["x", "account access please now"]), chat_tokenizer)
    assert any("label lengths differ a lot" in w for w in lint_labels(b))
    b = PromptBuilder(make_spec(tmp_path, labels=["x", "account access please now"], normalize="mean"), chat_tokenizer)
    assert not any("lengths" in w for w in lint_labels(b))


def test_identical_ids_are_refused(chat_tokenizer, tmp_path, monkeypatch):
    # Two spellings the byte-level tokenizer cannot tell apart do not exist, so force it:
    b = PromptBuilder(make_spec(tmp_path, labels=["a", "b"]), chat_tokenizer)
    real = b.candidate_ids
    monkeypatch.setattr(b, "candidate_ids", lambda text, whole=False: real("a" if text == "c" else text, whole))
    with pytest.raises(SpecError, match="tokenise to the same ids"):
        b.options(["a", "c"])


def test_many_groups_sharing_first_tokens_are_one_line(chat_tokenizer, tmp_path):
    labels = [f"{w} {v}" for w in ("tech", "bill", "account", "refund", "crash") for v in ("one", "two")]
    warnings = lint_labels(PromptBuilder(make_spec(tmp_path, labels=labels), chat_tokenizer))
    shared = [w for w in warnings if "share their first token" in w]
    assert len(shared) == 1 and shared[0].startswith("5 groups of labels share their first token ('tech one', 'tech two'")


def test_descriptions_hidden_by_list_false_are_a_warning(chat_tokenizer, tmp_path):
    from prefixcache.task.lint import lint_layout

    def warned(listed):
        spec = make_spec(tmp_path, questions={"team": {"type": "choice", "instructions": "Which team?", "list": listed,
                                                       "criteria": {"billing": "invoices and refunds", "tech": None}}})
        return lint_layout(PromptBuilder(spec, chat_tokenizer))

    assert warned(True) == []
    [line] = warned(False)
    assert line.startswith("question 'team': 'list: false' shows the model only the instructions") and "'billing'" in line
