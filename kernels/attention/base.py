"""What every attention backend shares: the start-up description of the attention it will run
(``AttentionSpec``), what a backend class can run (``BackendSupport``), the per-step decode
metadata, and the two base classes (decode, prefill).

A decode backend's life: the registry checks ``supports`` once at start-up and builds one
instance (which may allocate workspaces then); each step, ``build_metadata`` runs once for all
layers (FlashInfer plans there); each layer calls ``decode`` with that metadata.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from typing import ClassVar

import torch

FP8_E4M3 = torch.float8_e4m3fn
LATENT_16_BIT = (torch.bfloat16, torch.float16)


class BackendUnavailable(ValueError):
    """An explicitly requested attention backend cannot run here; the message names the flag."""


@dataclass(frozen=True)
class AttentionSpec:
    """The attention a runner will run, fixed at start-up (per GPU: heads after TP sharding)."""

    device: torch.device
    cache_dtype: torch.dtype  # the latent cache: bf16/fp16/fp32, or e4m3 with a per-layer scale
    num_heads: int
    kv_lora_rank: int
    rope_dim: int
    page_size: int
    softmax_scale: float
    compute_dtype: torch.dtype
    query_len: int = 1  # query tokens per decode request (s_q; > 1 for MTP)
    qk_head_dim: int = 0  # prefill's per-head q/k width (nope + rope); 0: not given
    v_head_dim: int = 0  # prefill's per-head value width; 0: not given


def device_capability(device: torch.device) -> tuple[int, int]:
    return torch.cuda.get_device_capability(device)


def dtype_name(dtype: torch.dtype) -> str:
    return "fp8 e4m3" if dtype == FP8_E4M3 else str(dtype).removeprefix("torch.")


@dataclass(frozen=True)
class BackendSupport:
    """What a backend class runs. ``None`` means any."""

    devices: tuple[str, ...]  # torch device types
    cache_dtypes: tuple[torch.dtype, ...]
    capability_majors: tuple[int, ...] | None = None  # CUDA compute capability major versions
    kv_lora_ranks: tuple[int, ...] | None = None
    rope_dims: tuple[int, ...] | None = None
    page_size_multiple: int = 1
    max_heads: int | None = None  # heads per GPU
    max_query_len: int | None = None  # query tokens per decode request
    cuda_graph_safe: bool = False  # no host work or host sync per call: replayable in a CUDA graph

    def unsupported_reason(self, spec: AttentionSpec) -> str | None:
        """Why ``spec`` is outside this support, or None when it is inside."""
        if spec.device.type not in self.devices:
            want = " or ".join("a CUDA GPU" if d == "cuda" else d for d in self.devices)
            return f"needs {want} (the engine runs on {spec.device.type})"
        if self.capability_majors is not None:
            if not torch.cuda.is_available():
                return "needs a CUDA GPU (torch sees none)"
            major, minor = device_capability(spec.device)
            if major not in self.capability_majors:
                want = " or ".join(f"SM{m}x" for m in self.capability_majors)
                return f"needs a {want} GPU; this one is SM{major}{minor}"
        if spec.cache_dtype not in self.cache_dtypes:
            names = ", ".join(dtype_name(d) for d in self.cache_dtypes)
            hint = " (--kv-cache-dtype fp8)" if self.cache_dtypes == (FP8_E4M3,) else ""
            return f"needs a KV cache in {names}{hint}; got {dtype_name(spec.cache_dtype)}"
        if self.kv_lora_ranks is not None and spec.kv_lora_rank not in self.kv_lora_ranks:
            return f"needs kv_lora_rank in {self.kv_lora_ranks}; the model has {spec.kv_lora_rank}"
        if self.rope_dims is not None and spec.rope_dim not in self.rope_dims:
            return f"needs a rope head dim in {self.rope_dims}; the model has {spec.rope_dim}"
        if spec.page_size % self.page_size_multiple:
            return f"needs a --block-size that is a multiple of {self.page_size_multiple}; got {spec.page_size}"
        if self.max_heads is not None and spec.num_heads > self.max_heads:
            return f"takes at most {self.max_heads} heads per GPU; got {spec.num_heads}"
        if self.max_query_len is not None and spec.query_len > self.max_query_len:
            return f"takes at most {self.max_query_len} query tokens per request; got {spec.query_len}"
        return None

    def describe(self) -> str:
        """One line for docs and ``--help``-style listings."""
        parts = ["/".join(self.devices)]
        if self.capability_majors:
            parts.append("SM" + "/".join(f"{m}x" for m in self.capability_majors))
        parts.append("cache " + "/".join(dtype_name(d) for d in self.cache_dtypes))
        if self.kv_lora_ranks:
            parts.append(f"latent {'/'.join(map(str, self.kv_lora_ranks))}")
        if self.page_size_multiple > 1:
            parts.append(f"block size %{self.page_size_multiple}")
        if self.max_heads:
            parts.append(f"<= {self.max_heads} heads")
        if self.max_query_len:
            parts.append(f"s_q <= {self.max_query_len}")
        parts.append("CUDA graphs" if self.cuda_graph_safe else "eager only")
        return ", ".join(parts)


def requested_backend(registry: dict, requested: str, spec: AttentionSpec, what: str, *formats: tuple[str, ...],
                      kind: str = ""):
    """The class of an explicitly requested backend, or ``BackendUnavailable`` saying why not
    (``what`` names the setting: the flag, or the prefill backend; ``formats``: the cache
    records, for the registries whose backends check them; ``kind``: e.g. "V4 ")."""
    cls = registry.get(requested)
    if cls is None:
        raise BackendUnavailable(f"{what}: unknown {kind}backend {requested!r}; one of auto, {', '.join(registry)}")
    reason = cls.unsupported_reason(spec, *formats)
    if reason is not None:
        raise BackendUnavailable(f"{what} {requested}: {reason}")
    return cls


def missing_module_reason(module: str, package: str) -> str | None:
    """The reason a backend cannot run when ``module`` is not importable here."""
    if importlib.util.find_spec(module) is None:
        return f"needs the {package} package, which is not installed"
    return None


@dataclass
class DecodeMetadata:
    """One step's decode requests, shared by every layer. The tensors are the step's (or a
    CUDA graph's persistent) device buffers, so a replay that refills them in place sees the
    new step; backends add what they derive once per step."""

    block_tables: torch.Tensor  # [B, max_pages] int32
    seq_lens: torch.Tensor  # [B] int32: context after this step, query tokens included
    query_len: int  # s_q

    @property
    def batch(self) -> int:
        return self.block_tables.shape[0]


class DecodeBackend:
    """Absorbed MLA decode over the paged latent cache (contract: ``kernels.mla_decode``)."""

    name: ClassVar[str]
    support: ClassVar[BackendSupport]
    # With an FP8 cache, whether the query is staged as e4m3 (else in the compute dtype).
    fp8_query: ClassVar[bool] = True

    def __init__(self, spec: AttentionSpec | None = None) -> None:
        self.spec = spec

    @classmethod
    def unsupported_reason(cls, spec: AttentionSpec) -> str | None:
        """Why this backend cannot run ``spec`` here (shape, dtype, device, missing package or
        library), or None. Called once, at start-up."""
        return cls.support.unsupported_reason(spec)

    @classmethod
    def supports(cls, spec: AttentionSpec) -> bool:
        return cls.unsupported_reason(spec) is None

    def query_dtype(self, cache_dtype: torch.dtype, compute_dtype: torch.dtype) -> torch.dtype:
        return FP8_E4M3 if cache_dtype == FP8_E4M3 and self.fp8_query else compute_dtype

    def build_metadata(self, block_tables: torch.Tensor, seq_lens: torch.Tensor, query_len: int) -> DecodeMetadata:
        """Once per step, before the first layer."""
        return DecodeMetadata(block_tables, seq_lens, query_len)

    def decode(
        self,
        q: torch.Tensor,
        kv_cache: torch.Tensor,
        metadata: DecodeMetadata,
        softmax_scale: float,
        kv_lora_rank: int,
        k_scale: float = 1.0,
        q_scale: float = 1.0,
        out_dtype: torch.dtype | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One layer: q [B, s_q, H, kv_lora_rank + rope] → (out [B, s_q, H, kv_lora_rank], lse)."""
        raise NotImplementedError


@dataclass
class VarlenSegments:
    """Ragged query blocks, each attending one key range: host lengths and device int32
    offsets (``cu_q`` / ``cu_k``, [n + 1]) of the same blocks."""

    q_lens: list[int]
    k_lens: list[int]
    cu_q: torch.Tensor
    cu_k: torch.Tensor


@dataclass
class ContextWindow:
    """A slice of a step's cached prefixes that is up-projected and attended at once: rows
    ``prefix_start:prefix_end`` of ``PrefillMetadata.prefix_slots`` (the cached rows of
    consecutive chunks, or part of one chunk's), and the query rows (of the step's chunk rows)
    of the chunks they belong to: ``row_start:row_end``, or, when a chunk without a prefix lies
    between them, the int32 indices ``rows``. ``segments`` pairs each of those chunks' queries
    with its keys in the slice (every query sees all of them: no mask)."""

    prefix_start: int
    prefix_end: int
    row_start: int
    row_end: int
    segments: VarlenSegments
    rows: torch.Tensor | None = None


@dataclass
class PrefillMetadata:
    """One step's prefill chunks, shared by every layer (built once per step by the forward
    context, then handed to the prefill backend's ``plan``).

    The chunks' query rows are consecutive in the step's flattened tokens, from ``row_start``.
    Each chunk attends causally to [its cached prefix ‖ its own rows]; the layer lays those
    keys/values out ragged, chunk after chunk (``kv_indptr``). ``prefix_slots`` lists the flat
    cache rows (page · page_size + offset) of every chunk's cached prefix, chunk after chunk, so
    one gather reads them all; ``kv_order[r]`` is the row of [gathered prefixes ‖ chunk rows]
    that lands at ragged key row r. Both are None when no chunk has a cached prefix."""

    row_start: int
    query_lens: list[int]  # per chunk, > 0
    context_lens: list[int]  # cached prefix per chunk
    qo_indptr: torch.Tensor  # [N+1] int32, device
    kv_indptr: torch.Tensor  # [N+1] int32, device
    prefix_slots: torch.Tensor | None  # [sum context_lens] int64, device
    kv_order: torch.Tensor | None  # [sum kv lens] int64, device
    # Set when the step's cached prefixes exceed the context workspace: they are then attended
    # window by window (kv_order is None), each chunk's own rows apart, merged by LSE.
    context_windows: list[ContextWindow] | None = None

    @property
    def own_segments(self) -> VarlenSegments:
        """Each chunk's queries over its own (new) rows: the keys are laid out as the queries."""
        return VarlenSegments(self.query_lens, self.query_lens, self.qo_indptr, self.qo_indptr)

    @property
    def num_chunks(self) -> int:
        return len(self.query_lens)

    @property
    def qo_indptr_cpu(self) -> list[int]:
        return _cumsum(self.query_lens)

    @property
    def kv_indptr_cpu(self) -> list[int]:
        return _cumsum([c + q for c, q in zip(self.context_lens, self.query_lens)])

    @property
    def row_end(self) -> int:
        return self.row_start + sum(self.query_lens)

    @property
    def max_query_len(self) -> int:
        return max(self.query_lens)

    @property
    def max_kv_len(self) -> int:
        return max(c + q for c, q in zip(self.context_lens, self.query_lens))


def _cumsum(values: list[int]) -> list[int]:
    out = [0]
    for v in values:
        out.append(out[-1] + v)
    return out


class PrefillBackend:
    """Causal attention of prompt chunks over their (up-projected) context.

    ``forward`` runs one sequence: q [Tq, H, Dqk], k [Tk, H, Dqk], v [Tk, H, Dv] → [Tq, H, Dv];
    the query block holds the last Tq positions of the Tk-long context (contract:
    ``kernels.mla_prefill``). ``forward_varlen`` runs every chunk of a step in one call, q and
    k/v ragged by the step's ``PrefillMetadata``; the base class loops ``forward`` over the
    chunks (the reference form), backends with a varlen kernel override it. ``plan`` runs once
    per step, before the first layer (FlashInfer plans there)."""

    name: ClassVar[str]
    support: ClassVar[BackendSupport]

    def __init__(self, spec: AttentionSpec | None = None) -> None:
        self.spec = spec

    @classmethod
    def unsupported_reason(cls, spec: AttentionSpec) -> str | None:
        return cls.support.unsupported_reason(spec)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, softmax_scale: float) -> torch.Tensor:
        raise NotImplementedError

    def value_width(self, qk_head_dim: int, v_head_dim: int) -> int:
        """How wide the caller should build v: its own width, or wider with zero columns for a
        backend whose kernels want v as wide as q/k (the output then has that width too, and
        the caller keeps its first ``v_head_dim`` columns)."""
        return v_head_dim

    def plan(self, metadata: PrefillMetadata) -> PrefillMetadata:
        return metadata

    def warm_up(self, max_chunk_tokens: int) -> int:
        """Run, before serving, every chunk shape whose first call would stall the host (a
        kernel library planning per sequence length); returns how many it ran (0: none need
        it). Called once at start-up on the thread that will run the steps."""
        return 0

    def attend_with_lse(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, segments: VarlenSegments,
                        causal: bool, softmax_scale: float) -> tuple[torch.Tensor, torch.Tensor]:
        """Ragged query blocks over their key ranges (``causal``: aligned to the bottom right)
        → (out [sum q, H, Dv], natural-log LSE [H, sum q] float32), for attention merged over
        several key sets (a step's context windows). The reference: one float32 block at a time."""
        from kernels.mla_prefill import attention_with_lse_reference

        out = q.new_empty(q.shape[0], q.shape[1], v.shape[-1])
        lse = torch.empty(q.shape[1], q.shape[0], dtype=torch.float32, device=q.device)
        q0 = k0 = 0
        for nq, nk in zip(segments.q_lens, segments.k_lens):
            out[q0 : q0 + nq], lse[:, q0 : q0 + nq] = attention_with_lse_reference(
                q[q0 : q0 + nq], k[k0 : k0 + nk], v[k0 : k0 + nk], causal, softmax_scale)
            q0, k0 = q0 + nq, k0 + nk
        return out, lse

    def forward_varlen(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, metadata: PrefillMetadata,
                       softmax_scale: float) -> torch.Tensor:
        """q [sum q_i, H, Dqk], k [sum kv_i, H, Dqk], v [sum kv_i, H, Dv] → [sum q_i, H, Dv]."""
        qo, kv = metadata.qo_indptr_cpu, metadata.kv_indptr_cpu
        if metadata.num_chunks == 1:
            return self.forward(q, k, v, softmax_scale)
        out = q.new_empty(q.shape[0], q.shape[1], v.shape[-1])
        for i in range(metadata.num_chunks):
            out[qo[i] : qo[i + 1]] = self.forward(q[qo[i] : qo[i + 1]], k[kv[i] : kv[i + 1]], v[kv[i] : kv[i + 1]],
                                                  softmax_scale)
        return out
