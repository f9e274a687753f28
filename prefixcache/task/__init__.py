"""The task: what is asked and how the answer is decided. No torch, no model, no files but the spec.

- spec.py: the YAML task spec in, a frozen, validated `TaskSpec` out (labels, template, examples,
  multiple choice, normalisation, calibration, threshold);
- prompt.py: the prompt around an item, the token-clean static prefix, the candidates' tokens;
- decision.py: from summed log-probabilities to a decision (normalisation, calibration, abstention);
- lint.py: label sets that first-token scoring would get wrong;
- overrides.py: the spec with what the command line or `Classifier` sets instead (-m, --gold).

May import: errors. Imported by every layer above it.
"""
