"""prefixcache: classify batches of text with a local causal LM, encoding the static prompt prefix once."""

__version__ = "0.1.0"
