"""The model, the engine and the attention kernel: torch lives here.

- load.py: finds and loads models and tokenizers (hub ids, folders, GGUF files, the embedded
  default), converting GGUF weights once into the cache;
- keptload.py: a GGUF file's model built with its quantised weights kept, never converted;
- kept.py: the linear and embedding layers that keep a GGUF file's codes and expand them to the
  precision they compute in as they run, to the converted model's values bit for bit;
- ggufblocks.py: a GGUF tensor's quantised blocks read as integer codes and per-group factors;
- lean.py: a converted model's weights read straight into the dtype they compute in, a slice at a
  time (and `with_attention`: SDPA, else the model's eager attention);
- safetensorsfile.py: a safetensors file's header, read without the library;
- heap.py: freed memory handed back to the system (glibc's malloc_trim);
- memory.py: the memory a model will take (weights, keys and values, a GGUF conversion), from its files;
- ggufheader.py: a GGUF file's header walked within bounds before anything parses it;
- protocol.py: what the rest of the program may ask of an engine (`ScoringEngine`), the seam;
- engine.py: prefills the static prefix once and scores batches of rows and their candidates
  against it in one forward pass (transformers on torch);
- layout.py: the prefilled prefix and a batch laid out over it (packed and padded, each row's
  trie), which engine.py runs and branches.py extends: no model runs there;
- llamacpp.py: the same on llama.cpp, a GGUF file kept quantised (llama-cpp-python's low-level API);
- precision.py: the precisions the transformers engine computes in, one registry entry each
  (load dtype, quantiser, packages, batch dependence, matrix unit, tolerance);
- int8.py: `--dtype int8` on the transformers engine: int8 weights and per-token int8 activations (torchao);
- engines.py: the engines there are, one registry entry each (name, refusal, memory, load,
  capabilities): what the rest of the program asks instead of an engine's name; `open_engine`
  and the memory check before loading;
- backend.py: what the registry holds (`Load`, `Backend`) and the registry itself;
- transformersentry.py, llamaentry.py: each engine's entry (its refusal, memory, load and
  capabilities), in a module of its own;
- llamabuild.py: the CMake options that build llama.cpp for this CPU (needs nothing but Python);
- choice.py: which engine runs a model (`--backend`, the spec's `backend`, auto);
- attention.py: the cascade attention kernel that reads the shared prefix once per layer;
- branches.py: pruned scoring's passes: items run once and kept, then candidates' branches after them;
- llamabranches.py: the same on llama.cpp, the items kept between decodes, a sequence a branch;
- llamatoken.py: one token of a llama.cpp decode batch, shared by llamacpp.py and llamabranches.py;
- llamaprobe.py: a llama.cpp build checked once on this CPU in a child process (a crashing build
  stops in one line);
- cache.py: the cache's layout (where it is, models/ and prefixes/) and its environment variables;
- private.py: the cache is the user's alone: its folders, the signing secret, signatures;
- store.py: prefilled prefixes kept on disk across runs, verified;
- rows.py: what the engine scores (rows, candidates, their token trie);
- reference.py: the slow, obviously correct scorer the engine is tested against;
- template.py: the model's chat template rendered within bounds (size, numbers, time).

Knows nothing of specs, items or records. May import: compat, errors.
"""
