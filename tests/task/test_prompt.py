"""The prompt layout, the automatic token-clean prefix and the candidate tokens."""

from __future__ import annotations

import pytest
from conftest import NO_SYSTEM_CHAT, build_tokenizer
from helpers import LABELS, TEXTS, make_spec

from prefixcache.errors import SpecError
from prefixcache.task.prompt import PromptBuilder


def test_prefix_is_token_clean_for_every_item(chat_tokenizer, tmp_path):
    b = PromptBuilder(make_spec(tmp_path), chat_tokenizer)
    P = len(b.prefix_ids)
    for text in TEXTS:
        enc = b.encode_item({"text": text})
        whole = chat_tokenizer(b.render({"text": text}), add_special_tokens=False)["input_ids"]
        assert list(enc.ids) == whole
        assert list(enc.ids[: enc.prefix_len]) == list(b.prefix_ids[: enc.prefix_len])
        assert 0 < enc.prefix_len < len(enc.ids)
    # Ordinary items share the whole prefix, which reaches into the item template.
    enc = b.encode_item({"text": "The app crashes."})
    assert enc.prefix_len == P
    assert chat_tokenizer.decode(b.prefix_ids).endswith("<|im_start|>user\nTicket:")


def test_prefix_is_the_longest_run_no_item_can_break(chat_tokenizer, tmp_path):
    b = PromptBuilder(make_spec(tmp_path), chat_tokenizer)
    P = len(b.prefix_ids)
    # "Ticket: Hello" and "Ticket: Zebra" share the space token, but "Ticket: app" merges the
    # space into " app": one token more would not be the same for every item.
    hello, zebra, app = (b.encode_item({"text": t}).ids for t in ("Hello there", "Zebra", "app"))
    assert hello[: P + 1] == zebra[: P + 1]
    assert app[:P] == hello[:P] and app[P] != hello[P]


def test_chat_layout_and_candidates(chat_tokenizer, tmp_path):
    examples = [{"text": "charged twice", "label": "billing"}]
    b = PromptBuilder(make_spec(tmp_path, examples=examples), chat_tokenizer)
    assert b.mode == "chat"
    assert b.end_of_answer == "<|im_end|>"
    text = b.render({"text": "crash"})
    assert text == (
        "<|im_start|>system\nYou are a support ticket router.\n\nAnswer with exactly one of these labels:\n"
        + "".join(f"- {lab}\n" for lab in LABELS).rstrip("\n")
        + "<|im_end|>\n<|im_start|>user\nTicket: charged twice<|im_end|>\n"
        "<|im_start|>assistant\nbilling<|im_end|>\n<|im_start|>user\nTicket: crash<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    end = chat_tokenizer.convert_tokens_to_ids("<|im_end|>")
    for label, ids in b.candidates.items():
        assert ids[-1] == end
        assert chat_tokenizer.decode(ids[:-1]) == label
        joined = chat_tokenizer(text + label + "<|im_end|>", add_special_tokens=False)["input_ids"]
        assert joined == list(b.encode_item({"text": "crash"}).ids) + list(ids)


def test_label_descriptions_and_placeholder(chat_tokenizer, tmp_path):
    spec = make_spec(tmp_path, system="Route tickets.\nCategories:\n{labels}\nReply with one.",
                     labels={"billing": "money matters", "technical": "bugs"})
    assert spec.system_text() == "Route tickets.\nCategories:\n- billing: money matters\n- technical: bugs\nReply with one."


def test_plain_layout(plain_tokenizer, tmp_path):
    spec = make_spec(tmp_path, examples=[{"text": "charged twice", "label": "billing"}], labels=["billing", "tech"])
    b = PromptBuilder(spec, plain_tokenizer)
    assert b.mode == "plain"
    assert b.render({"text": "crash"}) == (
        "You are a support ticket router.\n\nAnswer with exactly one of these labels:\n- billing\n- tech\n\n"
        "Ticket: charged twice\nAnswer: billing\n\nTicket: crash\nAnswer:"
    )
    assert plain_tokenizer.decode(b.candidates["tech"]) == " tech\n"


def test_chat_format_needs_a_template(plain_tokenizer, tmp_path):
    with pytest.raises(SpecError, match="no chat template"):
        PromptBuilder(make_spec(tmp_path, format="chat"), plain_tokenizer)


def test_plain_format_can_be_forced(chat_tokenizer, tmp_path):
    assert PromptBuilder(make_spec(tmp_path, format="plain"), chat_tokenizer).mode == "plain"


def test_template_without_system_role(tmp_path):
    tok = build_tokenizer(NO_SYSTEM_CHAT)
    b = PromptBuilder(make_spec(tmp_path, labels=["a", "b"]), tok)
    text = b.render({"text": "hello"})
    assert text.startswith("<turn>user\nYou are a support ticket router.")
    assert text.endswith("Ticket: hello<end>\n<turn>assistant\n")
    assert b.end_of_answer == "<end>"


def test_an_empty_static_prefix_is_a_spec_error(plain_tokenizer, tmp_path):
    """Multiple choice, no system text, no examples, a tokenizer without BOS: nothing to cache."""
    spec = make_spec(tmp_path, system=None, labels=None, choices="options", template="{question}")
    with pytest.raises(SpecError, match="the static prompt prefix is empty .* add a 'system' text"):
        PromptBuilder(spec, plain_tokenizer)
