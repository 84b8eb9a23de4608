"""EngineConfig: every engine setting in one validated dataclass.

The CLI (server/cli.py) is the only place that parses flags; it fills this dataclass, and
the offline ``LLM(model=..., **engine_args)`` API fills it from keyword arguments.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields

from kernels.attention import DECODE_BACKENDS
from server.errors import InvalidRequestError

KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3")
DTYPES = ("auto", "float32", "bfloat16", "float16", "half", "bf16", "fp32", "float")
CUDAGRAPH_MODES = ("NONE", "FULL_DECODE_ONLY")
ATTENTION_BACKENDS = ("auto", *DECODE_BACKENDS)  # kernels/attention/ documents each and the auto policy

DEFAULT_CPU_KV_CACHE_BYTES = 256 * 1024 * 1024


class EngineConfigError(ValueError):
    """An engine setting is invalid; the message names the flag."""


@dataclass
class EngineConfig:
    model: str | None = None  # checkpoint directory; None: the bundled tiny model
    served_model_name: str | None = None
    tokenizer: str | None = None
    chat_template: str | None = None  # a template file, or the template text itself
    dtype: str = "auto"
    load_format: str = "auto"  # auto: the checkpoint's safetensors; dummy: random weights, no files
    kv_cache_dtype: str = "auto"
    device: str = "auto"  # auto | cpu | cuda
    seed: int = 0
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
    cudagraph_mode: str = "FULL_DECODE_ONLY"
    max_cudagraph_capture_size: int | None = None
    attention_backend: str = "auto"
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
    extra: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        def bad(flag: str, msg: str) -> None:
            raise EngineConfigError(f"{flag}: {msg}")

        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            bad("--kv-cache-dtype", f"must be one of {', '.join(KV_CACHE_DTYPES)}, got {self.kv_cache_dtype!r}")
        if self.load_format not in ("auto", "dummy"):
            bad("--load-format", f"must be auto or dummy, got {self.load_format!r}")
        if self.dtype not in DTYPES:
            bad("--dtype", f"must be one of auto, float32, bfloat16, float16, got {self.dtype!r}")
        if self.device not in ("auto", "cpu", "cuda"):
            bad("--device", f"must be auto, cpu or cuda, got {self.device!r}")
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            bad("--block-size", f"must be a power of two, got {self.block_size}")
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
