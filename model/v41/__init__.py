"""DeepSeek-V4.1 text model (plain torch reference): ``config`` (composite config.json),
``state`` (per-request decode state), ``compressor``, ``indexer``, ``attention``, ``moe``,
``engram``, ``mhc`` (single-pass schedule), ``fp8_linear`` (the FP8 linears as stored, run as
MXFP8, or dequantized), ``model`` (the causal LM, and
:func:`~model.v41.model.load_deepseek_v41`), ``training`` (the batched, differentiable
full-sequence forward a trainer uses). Shared V4 pieces come from ``model.v4``; the
weighted RMSNorm is ``model.layers.norm.RMSNorm`` with ``weight_after_cast=True``; the QAT
fake-quant references come from ``kernels.microscaling``."""
