"""DeepSeek-V4.1 text model (plain torch reference): ``config`` (composite config.json),
``state`` (per-request decode state), ``compressor``, ``indexer``, ``attention``, ``moe``,
``engram``, ``mhc`` (single-pass schedule), ``norm``, ``model`` (the causal LM). Shared V4
pieces come from ``model.v4``; the QAT fake-quant references from ``kernels.microscaling``."""
