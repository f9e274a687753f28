"""The data files in and out. No torch.

- items.py: the input: lazy readers for JSONL, CSV, TSV, a JSON array, Parquet and stdin, yielding
  `Item`s, with errors that name the file and line;
- records.py: the record: one per item, its fields and its CSV cells (the only place that knows
  the record's layout);
- output.py: the output file: format, writer, reader, the checks before a run, the fingerprint
  file beside it;
- resume.py: how a run starts on its output and continues it: the fingerprint compared, resume,
  grown input and update, writing aside and renaming (the only place that writes an output);
- lock.py: one writer per output, an exclusive lock beside it for as long as a run writes it.

May import: task, errors. Imported by scoring, reports, run and cli.
"""
