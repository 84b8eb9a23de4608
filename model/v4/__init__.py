"""DeepSeek-V4 in plain torch: the shared building blocks and the V4 causal LM.

One concept per module: ``norm`` (unweighted RMSNorm), ``rope`` (two-base RoPE on the
trailing rope dims, YaRN without mscale, inverse rotation), ``mhc`` (manifold-constrained
hyper-connections and the HyperHead), ``attention_core`` (sink softmax over window plus
compressed entries, and its masks), ``output_proj`` (grouped low-rank output projection),
``moe`` (sqrt-softplus / hash routers, clamped SwiGLU experts), ``compressor`` (CSA/HCA
compressors and the lightning indexer), ``state`` (per-request decode state), ``attention``
(one V4 attention layer), ``config`` (the V4 config) and ``model`` (the causal LM, and
:func:`~model.v4.model.load_deepseek_v4`, which builds it from a checkpoint directory).
"""
