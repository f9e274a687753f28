"""What is said about outputs once written. No torch.

- evaluation.py: gold-label evaluation accumulated record by record, the gates, and the report
  files (--metrics JSON, --summary-md Markdown, --junit XML);
- questions.py: typed questions evaluated per question (each kind's metrics), their gates and
  report files;
- junit.py: the JUnit XML report both evaluations write (--junit);
- diff.py: two runs joined by id: flips, shifts, fixed and broken items, McNemar;
- drift.py: a run against a reference run on other items, without labels: its answers' shares,
  confidence and margins, abstained and failed items tested, what its fingerprint changed;
- htmlpage.py: `prefixcache report`, one self-contained HTML page (matplotlib, an optional extra);
- markdown.py: text from the data (ids, labels, file names) made safe in Markdown;
- resampling.py: what tune and the labelled-data loop share: folds keeping a text's copies together,
  bootstrap resamples, bias-corrected intervals.

May import: data, task, errors. Imported by run, tune, labelled and cli. The terminal's tables are cli/show.py.
"""
