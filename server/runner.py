"""Model runner: turns a SchedulerOutput into tensors, runs the model, samples.

It owns the model, the paged KV cache tensors (shaped by the model's KV-cache specs,
server/kv_cache_spec.py: today one full-attention group, a [num_blocks + 1, block_size, 576]
latent tensor per layer) and the per-sequence sampling state (seeded generators). Pure-decode steps
go through :meth:`ModelRunner._forward_decode`, the path the CUDA-graph work captures;
mixed prefill+decode steps run eagerly.
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass, field

import numpy as np
import torch

from kernels.fp8 import FP8_DTYPE
from kernels.attention import AttentionSpec, select_decode_backend, select_prefill_backend
from model.config import ModelConfig
from model.deepseek import DeepseekForCausalLM
from model.forward_context import ForwardContext, attention_arrays, build_attention_metadata, forward_context
from model.upload import to_device, upload_arrays
from server import envs
from server.config import DEFAULT_CPU_KV_CACHE_BYTES, EngineConfig
from server.kv_cache_spec import FullAttentionSpec, KVCacheSpec, max_num_blocks, plan_groups
from server.outputs import TokenLogprob
from server.sampler import Sampler, SamplingRow, compute_prompt_logprobs, make_request_generator
from server.scheduler import SchedulerOutput
from server.step_inputs import BlockTableRows
from server.step_profile import StepProfiler, classify_step, graphs_off_reason
from server.step_roofline import mla_step_costs
from server.sequence import Sequence

logger = logging.getLogger(__name__)


@dataclass
class StepPlan:
    """One step's inputs in plain python values and one int32 array; rank 0 sends it to its TP
    workers (``to_wire``: lists only). Positions follow from the context and query lengths."""

    input_ids: list[int]
    block_tables: np.ndarray | list[list[int]]  # [B, width] int32, zero-padded (lists from the wire)
    context_lens: list[int]
    query_lens: list[int]
    num_decodes: int
    logit_rows: list[int]
    all_rows_logits: bool = False  # logit_rows is every row of the step (pure decode, all sampled)

    def to_wire(self) -> list:
        tables = self.block_tables.tolist() if isinstance(self.block_tables, np.ndarray) else self.block_tables
        return [self.input_ids, tables, self.context_lens, self.query_lens, self.num_decodes, self.logit_rows,
                self.all_rows_logits]

    @classmethod
    def from_wire(cls, w: list) -> "StepPlan":
        return cls(*w)


@dataclass
class StepResult:
    """What one step produced, keyed by seq_id."""

    sampled: dict[int, int] = field(default_factory=dict)
    logprobs: dict[int, TokenLogprob] = field(default_factory=dict)
    # Prompt logprobs of the chunk's positions: (first prompt index covered, entries).
    prompt_logprobs: dict[int, tuple[int, list[TokenLogprob]]] = field(default_factory=dict)


@dataclass
class PendingStep:
    """A launched step whose sampled tokens may still be on their way back from the GPU
    (async scheduling). ``result`` is set once collected (or at launch for a synchronous step)."""

    result: StepResult | None = None
    seq_ids: list[int] = field(default_factory=list)  # sampled sequences, in row order
    token_ids: torch.Tensor | None = None  # [rows] on the device: the next step's placeholder inputs
    host_ids: torch.Tensor | None = None  # pinned copy, valid once ``ready`` has completed
    ready: "torch.cuda.Event | None" = None

    @functools.cached_property
    def row_of_seq(self) -> dict[int, int]:
        return {sid: i for i, sid in enumerate(self.seq_ids)}


def _shifted_fill(fills, pending: PendingStep | None) -> int | None:
    """Where ``pending``'s whole token tensor lands when the fills are its rows 0..n-1 at
    consecutive inputs (steady decode: the same sequences in the same order), else None."""
    if not fills or len(fills) != pending.token_ids.shape[0]:
        return None
    at = fills[0][0]
    for j, (i, row) in enumerate(fills):
        if row != j or i != at + j:
            return None
    return at


def kv_cache_dtype(config: EngineConfig, model_dtype: torch.dtype) -> torch.dtype:
    return FP8_DTYPE if config.use_fp8_kv_cache else model_dtype


def attention_spec(model: DeepseekForCausalLM, config: EngineConfig, cache_dtype: torch.dtype,
                   device: torch.device) -> AttentionSpec:
    """What the attention backends are chosen for: this rank's heads, the cache, the block size."""
    attn = model.layers[0].self_attn
    return AttentionSpec(device=device, cache_dtype=cache_dtype, num_heads=attn.num_local_heads,
                         kv_lora_rank=attn.kv_lora_rank, rope_dim=attn.rope_dim, page_size=config.block_size,
                         softmax_scale=attn.softmax_scale, compute_dtype=attn.compute_dtype,
                         qk_head_dim=attn.qk_dim, v_head_dim=attn.v_dim)


def model_kv_cache_specs(model_config: ModelConfig, config: EngineConfig,
                         model_dtype: torch.dtype) -> list[KVCacheSpec]:
    """The model's KV-cache layer groups: every DeepSeek V2/V3/R1 layer caches MLA's latent
    (kv_lora_rank + qk_rope_head_dim values per token), so one full-attention group."""
    return [FullAttentionSpec(config.block_size, kv_cache_dtype(config, model_dtype),
                              tuple(range(model_config.num_hidden_layers)), model_config.kv_cache_entry_dim)]


@torch.inference_mode()
def profile_activation_bytes(model: DeepseekForCausalLM, num_tokens: int, num_logit_rows: int,
                             max_position: int | None = None) -> int:
    """Peak activation memory of the largest step: a ``num_tokens``-token prefill (no cache)
    plus logits for ``num_logit_rows`` rows, measured by running it (every TP rank runs it).
    Positions wrap at ``max_position``: a step holds up to the token budget however short each
    sequence may be, and its rows are costed as one causal run."""
    device = next(model.parameters()).device
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    base = torch.cuda.memory_allocated(device)
    ids = torch.zeros(num_tokens, dtype=torch.long, device=device)
    positions = torch.arange(num_tokens, device=device)
    hidden = model(ids, positions % max_position if max_position else positions)
    model.compute_logits(hidden[: max(1, min(num_logit_rows, num_tokens))])
    del hidden
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device) - base
    torch.cuda.empty_cache()
    return peak


def determine_num_blocks(
    config: EngineConfig, model_config: ModelConfig, model_dtype: torch.dtype, device: torch.device,
    model: DeepseekForCausalLM | None = None, max_model_len: int | None = None,
) -> int:
    """KV capacity: the override, else a byte budget (CPU), else on GPU what
    ``--gpu-memory-utilization`` leaves after the weights and a profiled largest step."""
    if config.num_gpu_blocks_override is not None:
        return config.num_gpu_blocks_override
    specs = model_kv_cache_specs(model_config, config, model_dtype)
    if device.type == "cuda":
        peak = 0
        if model is not None:
            from server.scheduler import resolve_max_num_batched_tokens

            # The whole step budget, as the scheduler fills it: with --max-model-len below it a
            # step still carries that many tokens, over several sequences.
            max_len = max_model_len or model_config.max_position_embeddings
            tokens = resolve_max_num_batched_tokens(config, max_len)
            peak = profile_activation_bytes(model, tokens, config.max_num_seqs, max_position=max_len)
        total = torch.cuda.get_device_properties(device).total_memory
        used = torch.cuda.memory_allocated(device) + peak
        budget = int(total * config.gpu_memory_utilization) - used
    else:
        budget = config.kv_cache_memory_bytes or DEFAULT_CPU_KV_CACHE_BYTES
    num_blocks = max_num_blocks(specs, budget, config.max_num_seqs)
    if num_blocks < 1:
        per_block = sum(g.num_bytes for g in plan_groups(specs, 1, config.max_num_seqs))
        raise RuntimeError(
            f"not enough memory for even one KV block ({per_block} bytes per block, budget {budget}); "
            "raise --gpu-memory-utilization / --kv-cache-memory-bytes or lower --block-size"
        )
    return num_blocks


class ModelRunner:
    plan_class = StepPlan  # what the TP workers decode the engine's plans into
    append_only_block_tables = True  # full attention: a table only ever grows (BlockTableRows)

    def __init__(self, model: DeepseekForCausalLM, config: EngineConfig, num_blocks: int, device: torch.device) -> None:
        self._init_step_state(model, config, num_blocks, device)
        cache_dtype = kv_cache_dtype(config, model.dtype)
        self.kv_cache_specs = model_kv_cache_specs(self.model_config, config, model.dtype)
        self.kv_caches = self._allocate_kv_caches(plan_groups(self.kv_cache_specs, num_blocks, config.max_num_seqs))
        # Per-layer FP8 scale (k_scale). Checkpoints rarely carry one for MLA; 1.0 like vLLM's default.
        self.kv_scales = [1.0] * len(model.layers)
        # Chosen once for the runner's lifetime (the decode backend may hold workspaces).
        spec = attention_spec(model, config, cache_dtype, device)
        self.decode_backend = select_decode_backend(config.attention_backend, spec)
        self.prefill_backend = select_prefill_backend(config.prefill_attention_backend, spec)

    def _init_step_state(self, model, config: EngineConfig, num_blocks: int, device: torch.device) -> None:
        """What every runner has whatever the model: sampling, per-sequence generators, the
        async-scheduling placeholders, profiling."""
        self.model = model
        self.config = config
        self.device = device
        self.model_config = model.config
        self.block_size = config.block_size
        self.num_blocks = num_blocks
        self.sampler = Sampler(config.seed)
        self.eos_token_ids = self.model_config.eos_token_ids
        self._generators: dict[int, torch.Generator | None] = {}
        # Tokens sampled by the previous step, for placeholder inputs (async scheduling).
        self._last_sampled: dict[int, int] = {}
        self.block_rows = BlockTableRows(self.append_only_block_tables)
        # Set when TP workers follow this runner: called with each step's plan before it runs.
        self.plan_broadcaster = None
        self.decode_graphs = None  # server.cuda_graphs.DecodeGraphs, once captured
        # Off unless MLASERVE_STEP_PROFILE / enabled; prices each step for its roofline lines.
        self.step_profiler = StepProfiler(device=device, cost_model=mla_step_costs(model, config))
        # Cached-prefix rows a prefill step up-projects at once (None: all of them). Opt-in:
        # on the GPU the windowed path has not yet measured as fast as the one gather.
        self.context_workspace_tokens = envs.MLASERVE_CONTEXT_WORKSPACE_TOKENS or None
        self.num_overlapped_steps = 0  # steps launched before the previous step's tokens were read

    def _allocate_kv_caches(self, groups) -> list[torch.Tensor]:
        """One tensor per layer, ``[pool + 1, *page_shape]`` of its group's spec. The extra page
        is where pad rows (slot -1) write, so cache writes keep fixed shapes (CUDA graphs)."""
        if len(groups) != 1:  # the step plan carries one block table per sequence
            raise NotImplementedError(f"{len(groups)} KV cache groups: the runner plans one group's tables")
        caches: list[torch.Tensor | None] = [None] * len(self.model.layers)
        for group in groups:
            spec = group.spec
            for layer in spec.layer_ids:
                caches[layer] = torch.zeros((group.num_blocks + 1, *spec.page_shape), dtype=spec.dtype,
                                            device=self.device)
        missing = [i for i, c in enumerate(caches) if c is None]
        if missing:
            raise ValueError(f"layers {missing} belong to no KV cache group")
        return caches

    # ---- sequence lifecycle -----------------------------------------------------------------
    def _generator(self, seq: Sequence) -> torch.Generator | None:
        if seq.seq_id not in self._generators:
            seed = seq.sampling_params.seed
            # The n sequences of one seeded request draw different samples, reproducibly.
            self._generators[seq.seq_id] = make_request_generator(
                None if seed is None else seed + seq.index, self.device
            )
        return self._generators[seq.seq_id]

    def release(self, seq_ids) -> None:
        for sid in seq_ids:
            self._generators.pop(sid, None)
            self._last_sampled.pop(sid, None)
        self.block_rows.release(seq_ids)

    # ---- step -------------------------------------------------------------------------------
    def plan(self, out: SchedulerOutput, pending: PendingStep | None = None
             ) -> tuple["StepPlan", list[tuple[int, int]]]:
        """The step's inputs (what TP workers receive: no tensors, no pickle) and the fills: a
        placeholder whose token is still in flight in ``pending`` gets a 0 in the plan and an
        entry (input index, row of ``pending.token_ids``), copied on the device."""
        fills: list[tuple[int, int]] = []
        in_flight = pending.row_of_seq if pending is not None and pending.result is None else {}
        ids: list[int] = []
        ctx_lens, q_lens, logit_rows = [], [], []
        offset = 0
        prompt_rows = False
        for entry in out.scheduled:
            seq = entry.seq
            start, q = entry.start_pos, entry.num_new_tokens
            known = q - entry.num_placeholder_tokens
            if known == 1:
                ids.append(seq.all_token_ids[start])
            elif known:
                ids.extend(seq.all_token_ids[start : start + known])
            if entry.num_placeholder_tokens:
                row = in_flight.get(seq.seq_id)
                if row is not None:
                    fills.append((len(ids), row))
                    ids.append(0)
                else:
                    ids.append(self._last_sampled[seq.seq_id])
            ctx_lens.append(start)
            q_lens.append(q)
            # Rows whose logits are needed: prompt-logprob positions, then the sampled row.
            if seq.sampling_params.prompt_logprobs is not None:
                for row in self._prompt_logprob_rows(entry):
                    logit_rows.append(offset + row)
                    prompt_rows = True
            if entry.sample:
                logit_rows.append(offset + q - 1)
            offset += q
        if prompt_rows:
            logit_rows = sorted(set(logit_rows))
        tables = self.block_rows.gather([e.seq for e in out.scheduled])
        return StepPlan(ids, tables, ctx_lens, q_lens, out.num_decodes, logit_rows,
                        all_rows_logits=len(logit_rows) == offset), fills

    @staticmethod
    def _prompt_logprob_rows(entry) -> range:
        seq = entry.seq
        if seq.sampling_params.prompt_logprobs is None or entry.num_placeholder_tokens:
            return range(0)
        last = min(entry.start_pos + entry.num_new_tokens, seq.num_prompt_tokens - 1)
        return range(max(0, last - entry.start_pos))

    @torch.inference_mode()
    def run_plan(self, plan: "StepPlan", profile=None, fills=None, pending: PendingStep | None = None) -> torch.Tensor:
        """Forward the step and return float32 logits of ``plan.logit_rows`` (every TP rank).
        ``profile``: the step's StepRecord when profiling; the ``plan`` phase ends here.
        ``fills``: placeholder inputs to take from ``pending.token_ids`` on the device.
        Every host input of the step reaches the device in one copy (``upload_arrays``)."""
        arrays = attention_arrays(plan.block_tables, plan.context_lens, plan.query_lens, self.block_size)
        host = [*arrays.device_arrays(), np.array(plan.input_ids, dtype=np.int64), arrays.positions]
        if not plan.all_rows_logits:
            host.append(np.array(plan.logit_rows, dtype=np.int64))
        shifted = _shifted_fill(fills, pending)
        if fills and shifted is None:
            host += [np.array(f, dtype=np.int64) for f in zip(*fills)]
        dev = upload_arrays(host, self.device)
        md = arrays.metadata(dev[:4], num_decode_seqs=plan.num_decodes)
        input_ids, pos = dev[4], dev[5]
        if shifted is not None:  # the previous step's tokens, in order: one device copy
            input_ids[shifted : shifted + pending.token_ids.shape[0]] = pending.token_ids
        elif fills:
            input_ids[dev[-2]] = pending.token_ids[dev[-1]]
        ctx = self.forward_context(md)
        if profile is not None:
            self.step_profiler.mark(profile, "plan")
        if plan.num_decodes and plan.num_decodes == len(plan.query_lens):
            hidden = self._forward_decode(input_ids, pos, ctx)
        else:
            hidden = self._forward_mixed(input_ids, pos, ctx)
        return self.model.compute_logits(hidden if plan.all_rows_logits else hidden[dev[6]])

    def _input_ids(self, plan: "StepPlan", fills, pending: PendingStep | None) -> torch.Tensor:
        """The plan's token ids on the device, placeholders filled from ``pending.token_ids``."""
        input_ids = to_device(plan.input_ids, torch.long, self.device)
        if fills:
            at, rows = zip(*fills)
            src = pending.token_ids[to_device(rows, torch.long, self.device)]
            input_ids[to_device(at, torch.long, self.device)] = src
        return input_ids

    @torch.inference_mode()
    def execute(self, out: SchedulerOutput) -> StepResult:
        self.release(out.finished_seq_ids)
        self.block_rows.release(out.preempted_seq_ids)
        result = StepResult()
        if out.is_empty:
            return result
        prof = self.step_profiler.begin() if self.step_profiler.enabled else None
        plan, _ = self.plan(out)
        if prof is not None:
            prof.num_seqs, prof.num_tokens = len(plan.query_lens), len(plan.input_ids)
            prof.kind, prof.reason = classify_step(plan.num_decodes, len(plan.query_lens), self.decode_graphs,
                                                   graphs_off_reason(self.device, self.config), self.graph_fits(plan))
            if self.step_profiler.cost_model is not None:
                prof.cost = self.step_profiler.cost_model.cost(plan.context_lens, plan.query_lens, plan.num_decodes,
                                                               len(plan.logit_rows))
        if self.plan_broadcaster is not None:
            self.plan_broadcaster(plan)
        logits = self.run_plan(plan, prof)
        if prof is not None:
            self.step_profiler.mark(prof, "forward")
        self._sample(out, logits, plan, result)
        if any(e.seq.sampling_params.prompt_logprobs is not None for e in out.scheduled):
            self._prompt_logprobs(out, logits, {r: i for i, r in enumerate(plan.logit_rows)}, result)
        self._last_sampled.update(result.sampled)
        if prof is not None:
            self.step_profiler.end_runner_step(prof, "sample")
        return result

    # ---- async scheduling: launch step N+1 before step N's tokens reach the host -----------
    def can_overlap(self, out: SchedulerOutput) -> bool:
        """Whether ``out`` can be launched before the previous step's tokens are on the host:
        one GPU (TP workers receive host-side plans; DP ranks keep lockstep), no profiling (it
        synchronizes anyway), and no row that needs host-side token history or readbacks (penalties,
        logprobs, prompt logprobs)."""
        if (not self.config.async_scheduling or self.config.world_size > 1 or self.plan_broadcaster is not None
                or self.step_profiler.enabled):
            return False
        for entry in out.scheduled:
            p = entry.seq.sampling_params
            if p.prompt_logprobs is not None or (entry.sample and (
                    p.logprobs is not None or p.repetition_penalty != 1.0 or p.frequency_penalty != 0.0
                    or p.presence_penalty != 0.0)):
                return False
        return True

    @torch.inference_mode()
    def launch(self, out: SchedulerOutput, pending: PendingStep | None = None) -> PendingStep:
        """Start ``out`` on the device. When :meth:`can_overlap` allows, nothing waits for the
        GPU: placeholders of tokens still in flight in ``pending`` are filled on the device and
        the new tokens are copied back asynchronously (read them with :meth:`collect`).
        Otherwise ``pending`` is collected first and the step runs synchronously."""
        if out.is_empty or not self.can_overlap(out):
            if pending is not None:
                self.collect(pending)
            return PendingStep(result=self.execute(out))
        self.release(out.finished_seq_ids)
        self.block_rows.release(out.preempted_seq_ids)
        plan, fills = self.plan(out, pending)
        logits = self.run_plan(plan, fills=fills, pending=pending)
        rows, idx, seqs = self._sampling_rows(out, plan, in_flight=True)
        step = PendingStep(seq_ids=[seq.seq_id for seq in seqs])
        if not rows:
            step.result = StepResult()
            return step
        step.token_ids = self.sampler.sample_tokens(self._select(logits, idx), rows)
        if step.token_ids.is_cuda:
            step.host_ids = torch.empty(step.token_ids.shape, dtype=step.token_ids.dtype, pin_memory=True)
            step.host_ids.copy_(step.token_ids, non_blocking=True)
            step.ready = torch.cuda.Event()
            step.ready.record()
        else:
            step.host_ids = step.token_ids
        self.num_overlapped_steps += 1
        return step

    def collect(self, step: PendingStep) -> StepResult:
        """The step's result; waits only for that step's own token copy, not for later work."""
        if step.result is None:
            if step.ready is not None:
                step.ready.synchronize()
            result = StepResult(sampled=dict(zip(step.seq_ids, step.host_ids.tolist())))
            self._last_sampled.update(result.sampled)
            step.result = result
        return step.result

    def graph_fits(self, plan) -> bool | None:
        """Whether a pure-decode ``plan`` replays a graph, where more than its batch size decides
        (None: ``decode_graphs.fits(batch)``)."""
        return None

    @torch.inference_mode()
    def dummy_step(self) -> None:
        """One pad token, no attention work: keeps an idle DP rank's MoE collectives in step
        (its TP workers run the same dummy forward)."""
        if self.plan_broadcaster is not None:
            self.plan_broadcaster.dummy()
        md = build_attention_metadata([], [], [], self.block_size, num_pad_tokens=1, device=self.device)
        ids = torch.zeros(1, dtype=torch.long, device=self.device)
        with forward_context(self.forward_context(md)):
            self.model(ids, ids)

    def forward_context(self, md) -> ForwardContext:
        return ForwardContext(md, self.kv_caches, self.kv_scales, self.decode_backend, self.prefill_backend,
                              context_workspace_tokens=self.context_workspace_tokens)

    def _forward_decode(self, input_ids, positions, ctx: ForwardContext) -> torch.Tensor:
        """Pure-decode step: one token per sequence; replays a captured CUDA graph when one fits."""
        if self.decode_graphs is not None and self.decode_graphs.fits(input_ids.shape[0]):
            return self.decode_graphs.run(input_ids, positions, ctx.attn)
        with forward_context(ctx):
            return self.model(input_ids, positions)

    def _forward_mixed(self, input_ids, positions, ctx: ForwardContext) -> torch.Tensor:
        with forward_context(ctx):
            return self.model(input_ids, positions)

    def _sampling_rows(self, out: SchedulerOutput, plan: StepPlan, in_flight: bool = False):
        """(SamplingRow per sampled sequence, the logits rows they read or None when every logits
        row is a sampled one in order, the sequences). A placeholder's token is the last sampled
        one, or still ``in_flight`` on the device (then only counted: min_tokens)."""
        rows, idx, seqs = [], [], []
        offset = 0
        eos = self.eos_token_ids
        for entry in out.scheduled:
            if entry.sample:
                seq = entry.seq
                outputs, pending = seq.output_token_ids, 0
                if entry.num_placeholder_tokens:
                    if in_flight:
                        pending = 1
                    else:
                        outputs = outputs + [self._last_sampled[seq.seq_id]]
                rows.append(SamplingRow(seq.sampling_params, seq.prompt_token_ids, outputs, self._generator(seq), eos,
                                        pending))
                idx.append(offset + entry.num_new_tokens - 1)
                seqs.append(seq)
            offset += entry.num_new_tokens
        if len(rows) == len(plan.logit_rows):
            return rows, None, seqs
        row_of = {r: i for i, r in enumerate(plan.logit_rows)}
        return rows, [row_of[r] for r in idx], seqs

    @staticmethod
    def _select(logits: torch.Tensor, idx: list[int] | None) -> torch.Tensor:
        return logits if idx is None else logits[to_device(idx, torch.long, logits.device)]

    def _sample(self, out: SchedulerOutput, logits: torch.Tensor, plan: StepPlan, result: StepResult) -> None:
        rows, idx, seqs = self._sampling_rows(out, plan)
        if not rows:
            return
        res = self.sampler(self._select(logits, idx), rows)
        for seq, tok, lp in zip(seqs, res.token_ids, res.logprobs):
            result.sampled[seq.seq_id] = tok
            if lp is not None:
                result.logprobs[seq.seq_id] = lp

    def _prompt_logprobs(self, out: SchedulerOutput, logits: torch.Tensor, row_of: dict, result: StepResult) -> None:
        """Logprobs of prompt tokens 1.. given their prefixes, for chunks that ask for them."""
        offset = 0
        for entry in out.scheduled:
            rows = self._prompt_logprob_rows(entry)
            if len(rows):
                seq = entry.seq
                sel = torch.tensor([row_of[offset + r] for r in rows], device=logits.device)
                nxt = seq.prompt_token_ids[entry.start_pos + 1 : entry.start_pos + 1 + len(rows)]
                entries = compute_prompt_logprobs(logits[sel], nxt, seq.sampling_params.prompt_logprobs)
                result.prompt_logprobs[seq.seq_id] = (entry.start_pos + 1, entries)
            offset += entry.num_new_tokens
