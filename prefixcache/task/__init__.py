"""The task: what is asked and how the answer is decided. No torch, no model, no files but the spec (read, and rewritten by tuned.py).

- spec.py: `TaskSpec`, frozen and validated (labels, template, examples, multiple choice,
  normalisation, calibration, threshold), and what an item's fields mean to it (options, gold);
- keys.py: each key of a spec read into its typed value and checked; `spec_from_mapping`;
- specfile.py: the spec file: strict YAML, its text and digest (`SpecFile`), `load_spec`;
- prompt.py: the prompt around an item, the token-clean static prefix, the candidates' tokens;
- decision.py: from summed log-probabilities to a decision (normalisation, calibration, abstention);
- kind.py: what every kind of typed question shares: `Question`, the `Kind` contract and its
  registry, the pinned confidence formulas;
- questions.py: a `questions:` pack read and checked, what an item's scores decide per question
  (`Answers`);
- choice_kind.py, noul_kind.py, score_kind.py: one module per kind of question, each owning its
  keys, its prompt branch, what it scores, how it decides, its answer, its flat columns and its
  metrics;
- labels_kind.py, tags_kind.py, options_kind.py: a label spec as its one question (its labels,
  its labels judged one by one, an item's own options), each owning how it decides, what
  `--exact` measures of it, its record layout and its columns;
- scoring_metrics.py: the metrics the kinds share (per-class precision/recall/F1, calibration error);
- lint.py: label sets that first-token scoring would get wrong;
- texts.py: when two listed texts (options, labels, words) are one: equal once trimmed and NFC-normalised;
- overrides.py: the spec with what the command line or `Classifier` sets instead (-m, --gold);
- familiar.py: a head's fitted rows in brief (no text), and how far a new item lies from them;
- reliability.py: how often a head's held-out answers were right at each probability (`p_correct`);
- head.py: a fitted readout (`head:`): the head file read and checked, its fingerprint, and the
  probabilities it gives from hidden states (numpy, no torch);
- features.py: what a head reads of the forward (`Features`: the answer position's state, the mean
  over the item's tokens, of the final or a middle layer; the options' log-probs);
- tuned.py: a spec file rewritten with chosen keys (tune's and fit's), the user's comments kept.

May import: errors. Imported by every layer above it.
"""
