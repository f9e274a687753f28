"""Typed questions scored in one pass: every option, level and yes/no log-probability equals a
naive full forward of the whole prompt written out by hand, and a question's numbers do not move
when it is asked alone, reordered or renamed."""

from __future__ import annotations

import math

import pytest
from helpers import TEXTS, make_spec, naive_scores, text_items, tiny_scorer, write_spec

from prefixcache.model.engine import Engine
from prefixcache.model.load import ModelSource
from prefixcache.run.pipeline import classify
from prefixcache.scoring.prepare import Batching, Task
from prefixcache.scoring.scorer import Scorer
from prefixcache.task.specfile import load_spec

TOL = 1e-4
SYSTEM = "You read customer e-mails."
PACK = {
    "team": {"type": "choice", "instructions": "Which team should handle it?",
             "criteria": {"billing": "Invoices and charges", "technical support": None, "sales": "Buying more"}},
    "blocked": {"type": "noul", "instructions": "Is the customer blocked?", "criteria": {"true": "they cannot work"}},
    "mood": {"type": "score", "instructions": "How upset is the writer?", "criteria": ["calm", "annoyed", "angry"]},
    "area": {"type": "choice", "read": "letters", "instructions": "Which product area?",
             "criteria": {"mobile app": None, "web": "the website", "api": None, "exports": None}},
}
EXAMPLES = [
    {"text": "I was charged twice!", "answers": {"team": "billing", "blocked": False, "mood": 2}},
    {"text": "The API returns 500 for every call.", "answers": {"area": "api", "blocked": True}},
]




def _whole_prompt(tokenizer, spec, record, question) -> tuple[str, bool]:
    """The prompt up to one question's answer, written out by hand: the system turn, each
    example once per question it answers (in the order of the questions' text), then the item
    and the question; and whether the tokenizer adds its special tokens (plain layout)."""
    def ask(fields, q):
        return f"{spec.template.render(fields)}\n{q.branch()}"

    shots = []
    for ex in spec.examples:
        for q in sorted((spec.question_named(i) for i in ex["answers"]), key=lambda q: q.branch()):
            shots.append((ask(ex, q), q.said[q.options.index(ex["answers"][q.id])][0]))
    if tokenizer.chat_template:
        messages = [{"role": "system", "content": spec.system}]
        for said, answer in shots:
            messages += [{"role": "user", "content": said}, {"role": "assistant", "content": answer}]
        messages.append({"role": "user", "content": ask(record, question)})
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True), False
    blocks = [spec.system] + [f"{said}\n{spec.answer_prefix} {answer}" for said, answer in shots]
    return "\n\n".join(blocks + [f"{ask(record, question)}\n{spec.answer_prefix}"]), True


def naive_option_logprobs(model, tokenizer, spec, record, question) -> dict[str, float]:
    """Each option's summed log-probability, from a full forward of the whole prompt and answer,
    tokenised in one piece."""
    prompt, special = _whole_prompt(tokenizer, spec, record, question)
    end = tokenizer.eos_token if not special else "\n"
    stem = tokenizer(prompt, add_special_tokens=special)["input_ids"]
    out = {}
    for option, said in zip(question.options, question.said, strict=True):
        text = prompt + (f" {said[0]}" if special else said[0]) + end
        whole = tokenizer(text, add_special_tokens=special)["input_ids"]
        assert whole[: len(stem)] == stem
        out[option] = naive_scores(model, stem, [whole[len(stem):]])[0]
    return out


@pytest.mark.parametrize("mode,arch", [("chat", "llama"), ("plain", "qwen2")])
def test_every_answer_equals_a_full_forward_of_its_whole_prompt(mode, arch, chat_tokenizer, plain_tokenizer, tmp_path):
    from conftest import tiny_model

    tokenizer = chat_tokenizer if mode == "chat" else plain_tokenizer
    model = tiny_model(arch, len(tokenizer))
    spec = make_spec(tmp_path, system=SYSTEM, questions=PACK, examples=EXAMPLES, template="E-mail: {text}")
    texts = TEXTS[:5]
    got = list(classify(tiny_scorer(spec, tokenizer, model), text_items(texts), Batching(size=3)))
    worst, spread = 0.0, []
    for record, text in zip(got, texts, strict=True):
        for q in spec.questions:
            want = naive_option_logprobs(model, tokenizer, spec, {"text": text}, q)
            answer = record["answers"][q.id]
            worst = max([worst] + [abs(answer["x_logprobs"][o] - want[o]) for o in q.options])
            spread += list(want.values())
            probs = [math.exp(want[o] - max(want.values())) for o in q.options]
            probs = [p / sum(probs) for p in probs]
            if q.type == "noul":
                assert answer["noul"] == pytest.approx(probs[0], abs=TOL)
            else:
                assert list(answer["probabilities"].values()) == pytest.approx(probs, abs=TOL)
    assert worst < TOL
    assert max(spread) - min(spread) > 100 * TOL  # the check can fail: options and items differ


def _probabilities(records, qid):
    out = []
    for r in records:
        a = r["answers"][qid]
        out += [a["noul"]] if a["type"] == "noul" else list(a["probabilities"].values())
    return out


@pytest.mark.parametrize("examples", [[], EXAMPLES], ids=["zero-shot", "examples"])
def test_a_question_does_not_move_when_asked_alone_reordered_or_renamed(examples, chat_tokenizer, tmp_path):
    from conftest import tiny_model

    model = tiny_model("llama", len(chat_tokenizer))
    engine = Engine(model)
    texts = TEXTS[:4]

    def run(pack, exs, name):
        spec = load_spec(write_spec(tmp_path, name, system=SYSTEM, questions=pack, **({"examples": exs} if exs else {})))
        return list(classify(Scorer.start(Task(spec, ModelSource("tiny", "dir", "."), chat_tokenizer), engine),
                             text_items(texts), Batching(size=4)))

    everything = run(PACK, examples, "all.yaml")
    reordered = run(dict(reversed(list(PACK.items()))), examples, "reordered.yaml")
    renamed = run({f"q{i}": q for i, q in enumerate(PACK.values())}, [
        {**ex, "answers": {f"q{list(PACK).index(k)}": v for k, v in ex["answers"].items()}} for ex in examples],
        "renamed.yaml")
    for i, qid in enumerate(PACK):
        want = _probabilities(everything, qid)
        assert _probabilities(reordered, qid) == pytest.approx(want, abs=1e-5)
        assert _probabilities(renamed, f"q{i}") == pytest.approx(want, abs=1e-5)
        if not examples:  # with examples the prefix shows the other questions' example answers
            alone = run({qid: PACK[qid]}, [], f"alone-{qid}.yaml")
            assert _probabilities(alone, qid) == pytest.approx(want, abs=1e-5)
    assert everything[0]["answers"] != everything[1]["answers"]  # the items differ


def test_calibration_divides_out_each_questions_content_free_prior(chat_tokenizer, tmp_path):
    from conftest import tiny_model

    model = tiny_model("llama", len(chat_tokenizer))
    pack = {"team": {**PACK["team"], "calibrate": True}, "blocked": PACK["blocked"]}
    spec = make_spec(tmp_path, system=SYSTEM, questions=pack)
    scorer = tiny_scorer(spec, chat_tokenizer, model)
    (record,) = classify(scorer, text_items(TEXTS[:1]))
    team, blocked = record["answers"]["team"], record["answers"]["blocked"]
    assert "x_raw_probabilities" in team and "x_raw_noul" not in blocked
    prior = scorer.prior[0]
    raw = list(team["x_raw_probabilities"].values())
    weighted = [p / max(q, 1e-12) for p, q in zip(raw, prior, strict=True)]  # a prior is floored at 1e-12
    assert list(team["probabilities"].values()) == pytest.approx([w / sum(weighted) for w in weighted], abs=1e-9)
    assert scorer.prior[1] is None


def test_render_gives_each_question_the_tokens_an_independent_scorer_needs(chat_tokenizer, tmp_path):
    """One rendered line per item and question: scoring its candidates after its prompt_ids
    reproduces every x_logprobs of the run."""
    from conftest import tiny_model

    model = tiny_model("llama", len(chat_tokenizer))
    spec = make_spec(tmp_path, system=SYSTEM, questions=PACK, examples=EXAMPLES)
    scorer = tiny_scorer(spec, chat_tokenizer, model)
    items = text_items(TEXTS[:2])
    records = list(classify(scorer, items))
    for item, record in zip(items, records, strict=True):
        lines = scorer.task.renders(item)
        assert [line["question"] for line in lines] == list(PACK)
        for line in lines:
            q = spec.question_named(line["question"])
            scores = naive_scores(model, line["prompt_ids"], list(line["candidates"].values()))
            by_text = dict(zip(line["candidates"], scores, strict=True))
            for option, said in zip(q.options, q.said, strict=True):
                assert record["answers"][q.id]["x_logprobs"][option] == pytest.approx(by_text[said[0]], abs=TOL)
            assert ("options" in line) == (q.read == "letters")


def test_words_threshold_and_mean_decide_from_the_answers_tokens_only(chat_tokenizer, tmp_path):
    """An option with several words scores the log of their summed probability; `mean` divides
    by the answer's own tokens (never the question's); below `threshold` a choice abstains."""
    from conftest import tiny_model

    model = tiny_model("llama", len(chat_tokenizer))
    team = {"type": "choice", "instructions": "Which team?", "criteria": {"billing": None, "technical support": None},
            "words": {"billing": ["billing", "invoice"]}}
    import copy

    pack = {"team": team, "mean": {**copy.deepcopy(team), "normalize": "mean", "words": {}},
            "sure": {**copy.deepcopy(team), "normalize": "mean", "threshold": 0.999999, "words": {}}}  # no YAML aliases
    spec = make_spec(tmp_path, system=SYSTEM, questions=pack)
    scorer = tiny_scorer(spec, chat_tokenizer, model)
    (record,) = classify(scorer, text_items(TEXTS[:1]))
    (prep,) = [scorer.task.prepare(item) for item in text_items(TEXTS[:1])]
    ids = dict(zip(prep.candidates, zip(prep.candidates.values(), prep.skips, strict=True), strict=True))

    def naive(key):
        cand, skip = ids[key]
        return naive_scores(model, list(prep.enc.ids) + list(cand[:skip]), [cand[skip:]])[0], len(cand) - skip

    forms = [naive("team\x1fbilling")[0], naive("team\x1finvoice")[0]]
    top = max(forms)
    want = top + math.log(sum(math.exp(f - top) for f in forms))
    assert record["answers"]["team"]["x_logprobs"]["billing"] == pytest.approx(want, abs=TOL)
    (lb, nb), (lt, nt) = naive("mean\x1fbilling"), naive("mean\x1ftechnical support")
    assert nt > nb  # the options' own token counts differ, so the check can fail
    means = [lb / nb, lt / nt]
    probs = [math.exp(m - max(means)) for m in means]
    got = record["answers"]["mean"]["probabilities"]
    assert [got["billing"], got["technical support"]] == pytest.approx([p / sum(probs) for p in probs], abs=TOL)
    sure = record["answers"]["sure"]
    assert sure["probabilities"] == pytest.approx(got) and max(got.values()) < 0.999999  # as mean's, below the threshold
    assert sure["choice"] is None and record["answers"]["mean"]["choice"] is not None


def test_pmi_divides_out_each_options_score_after_the_content_free_prompt(chat_tokenizer, tmp_path):
    from conftest import tiny_model

    model = tiny_model("qwen2", len(chat_tokenizer))
    spec = make_spec(tmp_path, system=SYSTEM, questions={"team": {**PACK["team"], "normalize": "pmi"},
                                                          "blocked": PACK["blocked"]})
    scorer = tiny_scorer(spec, chat_tokenizer, model)
    (record,) = classify(scorer, text_items(TEXTS[:1]))
    (prep,) = [scorer.task.prepare(item) for item in text_items(TEXTS[:1])]
    empty = scorer.task.content_free("")
    pmi = []
    for key, cand, skip in zip(prep.candidates, prep.candidates.values(), prep.skips, strict=True):
        if key.startswith("team\x1f"):
            after = naive_scores(model, list(prep.enc.ids) + list(cand[:skip]), [cand[skip:]])[0]
            before = naive_scores(model, list(empty.ids) + list(cand[:skip]), [cand[skip:]])[0]
            pmi.append(after - before)
    probs = [math.exp(v - max(pmi)) for v in pmi]
    got = list(record["answers"]["team"]["probabilities"].values())
    assert got == pytest.approx([p / sum(probs) for p in probs], abs=TOL)
    plain = [record["answers"]["team"]["x_logprobs"][o] for o in spec.question_named("team").options]
    assert max(abs(a - b) for a, b in zip(pmi, plain, strict=True)) > 100 * TOL  # the content-free scores moved them


@pytest.mark.usefixtures("races_of_any_size")
@pytest.mark.parametrize("mode", ["on", "exact"])
@pytest.mark.parametrize("keys", [{}, {"calibrate": True}, {"normalize": "pmi"}])
def test_pruned_choice_questions_report_what_full_scoring_reports(keys, mode, chat_tokenizer, tmp_path, monkeypatch):
    """Pruning races each choice question's options (the other questions are scored to the
    end): the same choices, bounds from above for the options left at their bounds, fewer tokens
    through the model, and with "exact" every probability within 1e-4 of full scoring's (with
    "on", the options scored to the end have lower bounds)."""
    from conftest import planted, tiny_model

    from prefixcache.scoring import pruning

    monkeypatch.setattr(pruning, "DEEPEN", 100)  # races as deep as the options: more of them left at a bound
    words = "tech bill account refund invoice payment crash error slow login screen update".split()
    options = {f"{w} {v} {u}": None for w in words[:6] for v, u in zip(words[6:], words[:6], strict=True)}
    pack = {"topic": {"type": "choice", "instructions": "Which topic?", "criteria": options, **keys},
            "blocked": PACK["blocked"], "mood": PACK["mood"], "team": {**PACK["team"], "list": False}}
    spec = load_spec(write_spec(tmp_path, system=SYSTEM, questions=pack))
    model = planted(tiny_model("qwen2", len(chat_tokenizer), seed=5, init=1.0),
                    chat_tokenizer.convert_tokens_to_ids("<|im_end|>"))
    full, pruned = tiny_scorer(spec, chat_tokenizer, model), tiny_scorer(spec, chat_tokenizer, model)
    assert pruned.prune(mode) and not full.pruning
    want = list(classify(full, text_items(TEXTS[:6]), Batching(size=3)))
    got = list(classify(pruned, text_items(TEXTS[:6]), Batching(size=3)))
    bounded = 0
    for w, g in zip(want, got, strict=True):
        assert set(g["pruned"]) <= {"topic", "team"}
        for qid, answer in g["answers"].items():
            assert answer[answer["type"]] == w["answers"][qid][answer["type"]] or answer["type"] != "choice"
            for key in ("probabilities", "x_raw_probabilities"):
                for option, p in answer.get(key, {}).items():
                    if mode == "exact":
                        assert abs(p - w["answers"][qid][key][option]) < 1e-4
                    elif option not in g["pruned"].get(qid, ()):
                        assert p <= w["answers"][qid][key][option] + 1e-5
            for option, lp in answer["x_logprobs"].items():
                if option in g["pruned"].get(qid, ()):
                    bounded += 1
                    assert lp >= w["answers"][qid]["x_logprobs"][option] - TOL
                else:  # equal up to float32 summation order (a planted model's log-probs reach -300)
                    assert abs(lp - w["answers"][qid]["x_logprobs"][option]) < TOL + 2e-6 * abs(lp)
    assert bounded > 0  # the check can fail: options were left at their bounds
    assert pruned.engine.label_tokens < full.engine.label_tokens
