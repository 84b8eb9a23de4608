"""EngineConfig: every engine setting in one validated dataclass.

Every field is typed; nothing rides along untyped. The engine flags of ``serve`` and
``bench throughput`` come from one table (server/engine_args.py) that fills this dataclass,
and the offline ``LLM(model=..., **engine_args)`` API fills it from keyword arguments.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

from kernels.attention import DECODE_BACKENDS, PREFILL_BACKENDS, V4_PREFILL_BACKENDS
from kernels.mxfp8_gemm import LINEAR_BACKENDS
from server.errors import InvalidRequestError

KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3")
DTYPES = ("auto", "float32", "fp32", "float", "bfloat16", "bf16", "float16", "fp16", "half")
CUDAGRAPH_MODES = ("NONE", "FULL_DECODE_ONLY")
OPTIMIZATION_LEVELS = (0, 1, 2, 3)  # vLLM's -O0..-O3; here they only set the CUDA-graph default
ATTENTION_BACKENDS = ("auto", *DECODE_BACKENDS)  # kernels/attention/ documents each and the auto policy
# + triton: the DeepSeek-V4 family's sparse prefill (kernels/attention/v4_sparse_prefill.py)
PREFILL_ATTENTION_BACKENDS = ("auto", *PREFILL_BACKENDS, *(n for n in V4_PREFILL_BACKENDS if n not in PREFILL_BACKENDS))

DEFAULT_CPU_KV_CACHE_BYTES = 256 * 1024 * 1024


class EngineConfigError(ValueError):
    """An engine setting is invalid; the message names the flag."""


@dataclass
class EngineConfig:
    model: str | None = None  # checkpoint directory; None: the bundled tiny model
    served_model_name: str | None = None  # the name /v1/models reports (default: the model path)
    served_model_names: tuple[str, ...] = ()  # every accepted name, the reported one first
    tokenizer: str | None = None
    chat_template: str | None = None  # a template file, or the template text itself
    dtype: str = "auto"
    load_format: str = "auto"  # auto: the checkpoint's safetensors; dummy: random weights, no files
    kv_cache_dtype: str = "auto"
    device: str = "auto"  # auto | cpu | cuda
    seed: int = 0
    max_logprobs: int = 20  # vLLM's --max-logprobs: logprobs / top_logprobs / prompt_logprobs cap
    # scheduling
    max_model_len: int | None = None
    max_num_seqs: int = 256
    max_num_batched_tokens: int | None = None  # None: max(8192, max_model_len) unless chunked
    enable_chunked_prefill: bool = True
    block_size: int = 64
    enable_prefix_caching: bool = True
    async_scheduling: bool = False
    # memory
    gpu_memory_utilization: float = 0.9
    kv_cache_memory_bytes: int | None = None
    num_gpu_blocks_override: int | None = None
    swap_space: float = 4.0
    # execution
    enforce_eager: bool = False
    optimization_level: int = 2  # vLLM's default -O2
    cudagraph_mode: str | None = None  # None: from optimization_level (-O0: NONE, else FULL_DECODE_ONLY)
    cudagraph_capture_sizes: tuple[int, ...] | None = None  # decode batch sizes to capture (None: the default list)
    max_cudagraph_capture_size: int | None = None
    attention_backend: str = "auto"
    prefill_attention_backend: str = "auto"
    linear_backend: str = "auto"  # DeepSeek-V4.1's FP8 linears: auto | mxfp8 | dequantized (model/v41/fp8_linear.py)
    # parallelism
    tensor_parallel_size: int = 1
    data_parallel_size: int = 1
    enable_expert_parallel: bool = False
    tp_reduction: str = "reduce_scatter"  # or "all_reduce" (A/B comparison)
    nnodes: int = 1
    node_rank: int = 0
    master_addr: str = "127.0.0.1"
    master_port: int = 29555
    # misc
    trust_remote_code: bool = False

    def __post_init__(self) -> None:
        if self.cudagraph_mode is None and self.optimization_level in OPTIMIZATION_LEVELS:
            self.cudagraph_mode = "NONE" if self.optimization_level == 0 else "FULL_DECODE_ONLY"
        if self.served_model_names:
            self.served_model_names = tuple(self.served_model_names)
            if self.served_model_name is None:
                self.served_model_name = self.served_model_names[0]
        sizes = self.cudagraph_capture_sizes
        if sizes is not None:
            if not sizes or not all(isinstance(s, int) and not isinstance(s, bool) and s > 0 for s in sizes):
                raise EngineConfigError(f"--cudagraph-capture-sizes: expected positive integers, got {sizes!r}")
            self.cudagraph_capture_sizes = tuple(sorted(set(sizes)))
            if self.max_cudagraph_capture_size is None:  # vLLM: the largest listed size
                self.max_cudagraph_capture_size = self.cudagraph_capture_sizes[-1]
        self.validate()

    def validate(self) -> None:
        def bad(flag: str, msg: str) -> None:
            raise EngineConfigError(f"{flag}: {msg}")

        if self.optimization_level not in OPTIMIZATION_LEVELS:
            bad("-O/--optimization-level", f"must be 0, 1, 2 or 3, got {self.optimization_level!r}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            bad("--kv-cache-dtype", f"must be one of {', '.join(KV_CACHE_DTYPES)}, got {self.kv_cache_dtype!r}")
        if self.load_format not in ("auto", "dummy"):
            bad("--load-format", f"must be auto or dummy, got {self.load_format!r}")
        if self.dtype not in DTYPES:
            bad("--dtype", f"must be one of {', '.join(DTYPES)}, got {self.dtype!r}")
        if self.device not in ("auto", "cpu", "cuda"):
            bad("--device", f"must be auto, cpu or cuda, got {self.device!r}")
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            bad("--block-size", f"must be a power of two, got {self.block_size}")
        if self.max_logprobs < 0:
            bad("--max-logprobs", f"must be at least 0, got {self.max_logprobs}")
        if self.max_num_seqs < 1:
            bad("--max-num-seqs", f"must be at least 1, got {self.max_num_seqs}")
        if self.max_num_batched_tokens is not None and self.max_num_batched_tokens < 1:
            bad("--max-num-batched-tokens", f"must be at least 1, got {self.max_num_batched_tokens}")
        if self.max_model_len is not None and self.max_model_len < 1:
            bad("--max-model-len", f"must be at least 1, got {self.max_model_len}")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            bad("--gpu-memory-utilization", f"must be in (0, 1], got {self.gpu_memory_utilization}")
        if self.num_gpu_blocks_override is not None and self.num_gpu_blocks_override < 1:
            bad("--num-gpu-blocks-override", f"must be at least 1, got {self.num_gpu_blocks_override}")
        if self.kv_cache_memory_bytes is not None and self.kv_cache_memory_bytes < 1:
            bad("--kv-cache-memory-bytes", f"must be positive, got {self.kv_cache_memory_bytes}")
        if self.cudagraph_mode not in CUDAGRAPH_MODES:
            bad("--compilation-config.cudagraph_mode",
                f"must be one of {', '.join(CUDAGRAPH_MODES)}, got {self.cudagraph_mode!r}")
        if self.attention_backend not in ATTENTION_BACKENDS:
            bad("--attention-backend",
                f"must be one of {', '.join(ATTENTION_BACKENDS)}, got {self.attention_backend!r}")
        if self.prefill_attention_backend not in PREFILL_ATTENTION_BACKENDS:
            bad("--prefill-attention-backend", f"must be one of {', '.join(PREFILL_ATTENTION_BACKENDS)}, "
                f"got {self.prefill_attention_backend!r}")
        if self.linear_backend not in LINEAR_BACKENDS:
            bad("--linear-backend", f"must be one of {', '.join(LINEAR_BACKENDS)}, got {self.linear_backend!r}")
        if self.tensor_parallel_size < 1:
            bad("--tensor-parallel-size", f"must be at least 1, got {self.tensor_parallel_size}")
        if self.data_parallel_size < 1:
            bad("--data-parallel-size", f"must be at least 1, got {self.data_parallel_size}")
        if self.tp_reduction not in ("reduce_scatter", "all_reduce"):
            bad("--tp-reduction", f"must be reduce_scatter or all_reduce, got {self.tp_reduction!r}")
        if self.master_addr in ("0.0.0.0", "::", ""):
            bad("--master-addr", "must be the address of node 0, not a wildcard (internal channels never "
                "listen on every interface)")
        if self.max_cudagraph_capture_size is not None and self.max_cudagraph_capture_size < 1:
            bad("--max-cudagraph-capture-size", f"must be at least 1, got {self.max_cudagraph_capture_size}")
        sizes = self.cudagraph_capture_sizes
        if sizes is not None:
            if self.max_cudagraph_capture_size != max(sizes):
                bad("--max-cudagraph-capture-size", f"{self.max_cudagraph_capture_size} contradicts the largest "
                    f"capture size {max(sizes)} (give one of them, or make them agree)")
        if self.served_model_names and self.served_model_names[0] != self.served_model_name:
            bad("--served-model-name", f"the first name {self.served_model_names[0]!r} must be served_model_name "
                f"{self.served_model_name!r}")

    @property
    def use_fp8_kv_cache(self) -> bool:
        return self.kv_cache_dtype in ("fp8", "fp8_e4m3")

    @property
    def world_size(self) -> int:
        return self.tensor_parallel_size * self.data_parallel_size

    @classmethod
    def from_kwargs(cls, **kwargs) -> "EngineConfig":
        """Build from ``LLM(model=..., **engine_args)``; an unknown argument is an error."""
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(kwargs) - known)
        if unknown:
            raise EngineConfigError(f"unknown engine argument(s): {', '.join(unknown)}")
        return cls(**kwargs)


__all__ = ["EngineConfig", "EngineConfigError", "InvalidRequestError"]
