"""vllm-fst-backend: a finite-state-transducer structured-output backend for vLLM.

The package is laid out as the pipeline it implements:

* :mod:`vllm_fst_backend.artifacts` -- built once per tokenizer (vocabulary bytes, detokenizing FST,
  canonical-BPE filter, UTF-8 and script filters, on-disk format).
* :mod:`vllm_fst_backend.compiler` -- built once per request (regex -> byte DFA -> token DFA ->
  canonical product).
* :mod:`vllm_fst_backend.runtime` -- every decoding step (matcher state, bitmask fill, forced tokens).
* :mod:`vllm_fst_backend.vllm_plugin` -- the only module that imports vLLM internals.

No module imports from a later pipeline stage.
"""

__version__ = "0.1.0"
