"""Multi-label tagging and verbalizers: every label's probability equals a naive full forward of
the whole prompt per (item, label), built here from the chat template or the plain layout by hand."""

from __future__ import annotations

import math

import pytest
from helpers import TEXTS, make_spec, naive_scores

from prefixcache.data.items import Item
from prefixcache.model.engine import Engine
from prefixcache.model.load import ModelSource
from prefixcache.run.pipeline import classify
from prefixcache.scoring.prepare import Batching, Task
from prefixcache.scoring.scorer import Scorer
from prefixcache.task.prompt import common_prefix_len

TOL = 1e-4
TAGS = ["billing", "technical", "account access", "refund"]
TAG_EXAMPLES = [
    {"text": "I was charged twice, please refund.", "labels": ["billing", "refund"]},
    {"text": "The app crashes when I open a project.", "labels": ["technical"]},
    {"text": "Hello there", "labels": []},
]
SYSTEM = "You are a support ticket router."


def _scorer(spec, tokenizer, model):
    return Scorer.start(Task(spec, ModelSource("tiny", "dir", "."), tokenizer), Engine(model))


def _items(texts):
    return [Item(i, {"id": i, "text": t}, i + 1) for i, t in enumerate(texts)]


def _tag_prompt(tokenizer, spec, text, label, answer):
    """The whole prompt for one (item, label) question and answer, written out by hand."""
    ask = lambda body, lab: f"Ticket: {body}\n{spec.question.replace('{label}', lab)}"  # noqa: E731
    shots = [(ask(ex["text"], lab), spec.answers[0] if lab in ex["labels"] else spec.answers[1])
             for ex in TAG_EXAMPLES for lab in TAGS]
    system = spec.system_text()
    if tokenizer.chat_template:
        messages = [{"role": "system", "content": system}]
        for said, ans in shots:
            messages += [{"role": "user", "content": said}, {"role": "assistant", "content": ans}]
        messages.append({"role": "user", "content": ask(text, label)})
        prompt = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        return prompt + answer + "<|im_end|>", False
    blocks = [system] + [f"{said}\nAnswer: {ans}" for said, ans in shots] + [f"{ask(text, label)}\nAnswer: {answer}\n"]
    return "\n\n".join(blocks), True


def _naive_yes(model, tokenizer, spec, text, label):
    """log P(yes) / (P(yes) + P(no)) from full forwards of the two whole prompts."""
    (yes, special), (no, _) = (_tag_prompt(tokenizer, spec, text, label, a) for a in spec.answers)
    yes_ids, no_ids = (tokenizer(t, add_special_tokens=special)["input_ids"] for t in (yes, no))
    shared = common_prefix_len(yes_ids, no_ids)
    lp_yes, lp_no = naive_scores(model, yes_ids[:shared], [yes_ids[shared:], no_ids[shared:]])
    return -math.log1p(math.exp(lp_no - lp_yes))


@pytest.mark.parametrize("mode", ["chat", "plain"])
def test_tag_probabilities_equal_a_full_forward_per_label(mode, chat_tokenizer, plain_tokenizer, tmp_path):
    from conftest import tiny_model

    tokenizer = chat_tokenizer if mode == "chat" else plain_tokenizer
    model = tiny_model("llama", len(tokenizer))
    spec = make_spec(tmp_path, labels=TAGS, multi_label=True, examples=TAG_EXAMPLES, system=SYSTEM)
    texts = TEXTS[:6]
    got = list(classify(_scorer(spec, tokenizer, model), _items(texts), Batching(size=4)))
    worst, spread = 0.0, []
    for record, text in zip(got, texts):
        for label in TAGS:
            want = _naive_yes(model, tokenizer, spec, text, label)
            worst = max(worst, abs(record["logprobs"][label] - want), abs(record["probs"][label] - math.exp(want)))
            spread.append(want)
        assert record["labels"] == [lab for lab in TAGS if record["probs"][lab] >= 0.5]
    assert worst < TOL
    assert max(spread) - min(spread) > 100 * TOL  # the check can fail: labels and items differ


def test_verbalizer_scores_equal_the_summed_probability_of_the_forms(chat_tokenizer, tmp_path):
    from conftest import tiny_model

    model = tiny_model("qwen2", len(chat_tokenizer))
    labels = {"billing": {"words": ["billing", "payment", "invoice"]}, "technical": {"words": ["tech", "technical"]},
              "account": "sign-in problems"}
    spec = make_spec(tmp_path, labels=labels)
    scorer = _scorer(spec, chat_tokenizer, model)
    builder = scorer.task.builder
    for record, text in zip(classify(scorer, _items(TEXTS[:5]), Batching(size=3)), TEXTS[:5]):
        ids = builder.encode_item({"text": text}).ids
        want = {}
        for name, forms in (("billing", ["billing", "payment", "invoice"]), ("technical", ["tech", "technical"]),
                            ("account", ["account"])):
            lps = naive_scores(model, ids, [builder.candidate_ids(f) for f in forms])
            want[name] = math.log(sum(math.exp(lp) for lp in lps))
        assert max(abs(record["logprobs"][n] - want[n]) for n in want) < TOL
        total = sum(math.exp(v) for v in want.values())
        assert max(abs(record["probs"][n] - math.exp(want[n]) / total) for n in want) < TOL
