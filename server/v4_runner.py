"""The model runner of the DeepSeek-V4 family (V4, V4.1): per-request state objects instead of
paged MLA tensors, under the same scheduler, sampler and engine as R1.

Each step runs every prompt chunk through the model with its sequence's state
(``model(ids, state)``; ``model.new_state()``, model/v4/state.py and model/v41/state.py), one
request after the other, and every one-token chunk (decode tokens, and one-token prompt
chunks) of the step in ONE batched forward (``model.decode(ids [B], states)``: the
embedding, mHC, engram, linears and MoE over [B, hidden] rows; per layer, attention over
each request's window rows and (selected) compressed entries gathered into padded
[B, L, d] tensors with masks; the compressor and indexer updates of the requests whose
window closes in that step batched too). It takes logits at the rows the step needs
(prompt-logprob positions and the sampled row); sampling, logprobs, prompt logprobs,
seeded generators and async-scheduling placeholders are :class:`server.runner.ModelRunner`'s.

The states' rows live in the model's shared row pools (model/v4/cache_pool.py): rings for
the window and the open compressor windows, pages for the compressed entries and indexer
keys, so a token appends in place (O(1) amortized) and a batch reads its rows through index
tensors. ``--kv-cache-dtype fp8`` stores them as packed FP8/FP4 records
(kernels/v4_cache_formats.py; lossless for V4.1, whose values are already on those grids).

Chunked prefill carries the state. A chunk continues from the state the previous chunk left
(the open compressor windows, the CSA overlap half, the window rows, the emitted entries) at
any boundary, including boundaries inside a compressor window; the models are built so that
one-shot, chunked and token-by-token runs leave the same state (their golden tests check it).
Recomputing from cached rows instead would mean rerunning the open window's tokens through
the projections every chunk — the same result at extra cost.

State lifetime: created at a sequence's first chunk (position 0), advanced in place by every
step, dropped when the sequence finishes or is aborted (``release``) and when it is preempted
(recompute: its next chunk starts at position 0 again with a fresh state); a dropped state's
pool units go back to the pools at once (``state.release()``). The pools are sized once from
the block manager's plan (server/runner_setup.py), so its accounting bounds them. The ``n``
sequences of one request that run the same prompt chunk in the same step compute it once:
the others get a clone of the resulting state and the same logits (they sample with their
own generators).

Prefix caching restores whole states from snapshots taken at block boundaries
(server/v4_prefix_cache.py): each step's ``SchedulerOutput.prefix_snapshots`` says which
snapshots to drop, which sequences start from which snapshot, and where a chunk's state is
cloned (the chunk's forward is split there; such a one-token chunk runs on its own, not in
the batched decode). A snapshot is a ``state.clone()``: its own pool units.

The block manager accounts each state's rows in the specs of server/v4_kv_specs.py (record
sizes per cache dtype).

Tensor / data parallelism (model/v4_parallel.py): every TP rank keeps its own copy of every
state (the latent rows are replicated work). The engine's plan carries the sequence ids, the
share keys and the sequences whose states were dropped since the last plan (finished,
aborted, preempted), so a TP worker creates, shares and drops states exactly as the engine
does. Under DP the forwards of a step (each prompt chunk's and the one batched decode) are
kept in lockstep (server/v4_dp_lockstep.py). A step of one-token chunks only replays a
captured decode graph (server/v4_cuda_graphs.py; ``decode_graphs``, set at start-up) when its
batch fits the largest captured size; every other batched decode runs eagerly.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch

from model.upload import to_device
from server.config import DEFAULT_CPU_KV_CACHE_BYTES, EngineConfig
from server.kv_cache_spec import KVCacheSpec, max_num_blocks, plan_groups
from server.runner import ModelRunner, PendingStep, StepPlan, StepResult
from server.scheduler import SchedulerOutput
from server.v4_dp_lockstep import ForwardLockstep
from server.v4_prefix_cache import SnapshotStore

logger = logging.getLogger(__name__)


@dataclass
class V4StepPlan(StepPlan):
    """:class:`StepPlan` plus which sequence each chunk belongs to and, for a prompt chunk, a key
    that names identical work (same request, start and length) so siblings share it; the
    prefix-cache snapshots to restore before the step (seq_id, key) and to take in each chunk
    ([(position, key)]), so TP workers keep the same snapshots."""

    seq_ids: list[int] = field(default_factory=list)
    share_keys: list[str | None] = field(default_factory=list)
    released: list[int] = field(default_factory=list)  # states to drop before this step (TP workers)
    snapshot_drops: list[str] = field(default_factory=list)  # evicted snapshots to drop first (TP workers)
    restores: list[tuple[int, str]] = field(default_factory=list)
    takes: list[list[tuple[int, str]]] = field(default_factory=list)

    def to_wire(self) -> list:
        return super().to_wire() + [self.seq_ids, self.share_keys, self.released, self.snapshot_drops,
                                    self.restores, self.takes]


@torch.inference_mode()
def profile_v4_activation_bytes(model, num_tokens: int) -> int:
    """Peak memory of the largest step's forward: one ``num_tokens``-token prefill from an empty
    state plus the last row's logits, measured by running it."""
    device = next(model.parameters()).device
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    base = torch.cuda.memory_allocated(device)
    out = model(torch.zeros(num_tokens, dtype=torch.long, device=device), model.new_state())
    if hasattr(model, "compute_logits"):
        model.compute_logits(out[-1:])
    del out
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device) - base
    torch.cuda.empty_cache()
    return peak


def v4_num_blocks(config: EngineConfig, specs: list[KVCacheSpec], device: torch.device, model=None,
                  step_tokens: int = 0) -> int:
    """KV capacity in blocks: the override, else the byte budget (``--kv-cache-memory-bytes``,
    else ``--gpu-memory-utilization`` of the device less the weights and a profiled largest
    step of ``step_tokens``) over all specs."""
    if config.num_gpu_blocks_override is not None:
        return config.num_gpu_blocks_override
    if config.kv_cache_memory_bytes is not None:
        budget = config.kv_cache_memory_bytes
    elif device.type == "cuda":
        peak = profile_v4_activation_bytes(model, step_tokens) if model is not None and step_tokens else 0
        total = torch.cuda.get_device_properties(device).total_memory
        budget = int(total * config.gpu_memory_utilization) - torch.cuda.memory_allocated(device) - peak
    else:
        budget = DEFAULT_CPU_KV_CACHE_BYTES
    num_blocks = max_num_blocks(specs, budget, config.max_num_seqs)
    if num_blocks < 1:
        need = sum(g.num_bytes for g in plan_groups(specs, 1, config.max_num_seqs))
        raise RuntimeError(f"not enough memory for even one KV block ({need} bytes with the fixed per-request "
                           f"state of --max-num-seqs {config.max_num_seqs}, budget {budget}); raise "
                           "--gpu-memory-utilization / --kv-cache-memory-bytes or lower --max-num-seqs")
    return num_blocks


class V4FamilyRunner(ModelRunner):
    plan_class = V4StepPlan
    append_only_block_tables = False  # window / compressed groups release dead pages in place

    def __init__(self, model, config: EngineConfig, num_blocks: int, device: torch.device,
                 kv_cache_specs: list[KVCacheSpec]) -> None:
        self._init_step_state(model, config, num_blocks, device)
        self.kv_cache_specs = kv_cache_specs
        self.states: dict[int, object] = {}  # seq_id -> the model's per-request state
        self._has_head = hasattr(model, "compute_logits")  # V4: hidden states out; V4.1: logits
        self.num_shared_chunks = 0  # prompt chunks a sibling (n > 1) took from another's forward
        self.num_batched_decodes = 0  # one-token chunks that ran in a step's batched decode
        self._released: list[int] = []  # dropped since the last plan, for the TP workers
        self.lockstep = ForwardLockstep(model.par, self._dummy_forward)
        self.snapshots = SnapshotStore()  # prefix-cache state snapshots
        self._dropped_snapshots: list[str] = []  # evicted since the last plan, for the TP workers

    # ---- state lifetime ---------------------------------------------------------------------
    def release(self, seq_ids) -> None:
        super().release(seq_ids)
        self._drop_states(seq_ids)

    def _drop_preempted(self, out: SchedulerOutput) -> None:
        self._drop_states(out.preempted_seq_ids)
        if out.prefix_snapshots is not None and out.prefix_snapshots.drops:
            self.snapshots.drop(out.prefix_snapshots.drops)
            if self.plan_broadcaster is not None:
                self._dropped_snapshots += out.prefix_snapshots.drops

    def _drop_states(self, seq_ids) -> None:
        for sid in seq_ids:
            state = self.states.pop(sid, None)
            if state is not None:
                state.release()
                if self.plan_broadcaster is not None:
                    self._released.append(sid)

    def _state_at(self, seq_id: int, start: int):
        if start == 0:
            state = self.states[seq_id] = self.model.new_state()
            return state
        state = self.states.get(seq_id)
        if state is None or state.num_tokens != start:
            have = None if state is None else state.num_tokens
            raise RuntimeError(f"sequence {seq_id}: a chunk at position {start}, its state is at {have}")
        return state

    # ---- step -------------------------------------------------------------------------------
    def plan(self, out: SchedulerOutput, pending: PendingStep | None = None) -> tuple[V4StepPlan, list]:
        plan, fills = super().plan(out, pending)
        keys = []
        for entry in out.scheduled:
            seq = entry.seq
            in_prompt = entry.start_pos + entry.num_new_tokens <= seq.num_prompt_tokens
            keys.append(f"{seq.request_id}\0{entry.start_pos}\0{entry.num_new_tokens}"
                        if in_prompt and not entry.num_placeholder_tokens and seq.sampling_params.n > 1 else None)
        fields = {k: getattr(plan, k) for k in StepPlan.__dataclass_fields__}
        ops = out.prefix_snapshots
        seq_ids = [e.seq.seq_id for e in out.scheduled]
        restores = sorted(ops.restores.items()) if ops is not None else []
        takes = [ops.takes.get(sid, []) for sid in seq_ids] if ops is not None else [[] for _ in seq_ids]
        released, self._released = self._released, []
        dropped, self._dropped_snapshots = self._dropped_snapshots, []
        return V4StepPlan(**fields, seq_ids=seq_ids, share_keys=keys, released=released, snapshot_drops=dropped,
                          restores=restores, takes=takes), fills

    def _forward(self, ids: torch.Tensor, state, rows: list[int]) -> torch.Tensor | None:
        """Advance ``state`` by ``ids``; float32 logits of chunk rows ``rows`` (None if none)."""
        self.lockstep.before_forward()
        out = self.model(ids, state)
        if not rows:
            return None
        sel = out[to_device(rows, torch.long, out.device)]
        return self.model.compute_logits(sel) if self._has_head else sel

    @torch.inference_mode()
    def run_plan(self, plan: V4StepPlan, profile=None, fills=None, pending: PendingStep | None = None) -> torch.Tensor:
        """Prompt chunks through their sequences' states one by one, every one-token chunk of the
        step in one batched forward (``model.decode``); float32 logits of ``plan.logit_rows``."""
        for sid in plan.released:  # a TP worker: the engine dropped these states
            if (state := self.states.pop(sid, None)) is not None:
                state.release()
        self.snapshots.drop(plan.snapshot_drops)  # a TP worker: and evicted these snapshots
        input_ids = self._input_ids(plan, fills, pending)
        if profile is not None:
            self.step_profiler.mark(profile, "plan")
        wanted, j = plan.logit_rows, 0
        parts: list[torch.Tensor | None] = []
        decode: list[tuple[int, object, int, bool]] = []  # (chunk, state, its row in the step, wants logits)
        shared: dict[str, tuple[object, list[int], torch.Tensor | None]] = {}
        for sid, snapshot in plan.restores:
            self.states[sid] = self.snapshots.restore(snapshot)
        offset = 0
        for sid, start, q, key, takes in zip(plan.seq_ids, plan.context_lens, plan.query_lens, plan.share_keys,
                                             plan.takes):
            rows = []
            while j < len(wanted) and wanted[j] < offset + q:
                rows.append(wanted[j] - offset)
                j += 1
            done = shared.get(key) if key is not None else None
            logits = None
            if q == 1 and key is None and not takes:
                decode.append((len(parts), self._state_at(sid, start), offset, bool(rows)))
            elif done is not None and done[1] == rows and not takes and (start == 0 or sid in self.states):
                if start:
                    self._state_at(sid, start)  # checks the position
                if (old := self.states.pop(sid, None)) is not None:
                    old.release()  # before the clone takes its units
                self.states[sid] = done[0].clone()
                self.num_shared_chunks += 1
                logits = done[2]
            else:
                state = self._state_at(sid, start)
                if takes:
                    logits = self.snapshots.forward(self._forward, input_ids[offset:offset + q], state, rows,
                                                    start, takes)
                else:
                    logits = self._forward(input_ids[offset:offset + q], state, rows)
                if key is not None:
                    shared[key] = (state, rows, logits)
            parts.append(logits)
            offset += q
        if decode:
            self._decode(input_ids, decode, parts, pure=len(decode) == len(plan.seq_ids))
        self.lockstep.finish()
        parts = [p for p in parts if p is not None]
        if not parts:
            return torch.empty(0, self.model_config.vocab_size, dtype=torch.float32, device=self.device)
        return torch.cat(parts)

    def _decode(self, input_ids: torch.Tensor, decode: list[tuple[int, object, int, bool]],
                parts: list[torch.Tensor | None], pure: bool) -> None:
        """Advance every one-token chunk's state in one forward (a captured graph when the step
        is ``pure``: one-token chunks only, at most the largest captured size); logits into
        ``parts`` where wanted."""
        rows = to_device([d[2] for d in decode], torch.long, input_ids.device)
        self.lockstep.before_forward()
        graphs, states = self.decode_graphs, [d[1] for d in decode]
        if pure and graphs is not None and graphs.fits(len(decode), states):
            out = graphs.run(input_ids[rows], states)
        else:
            out = self.model.decode(input_ids[rows], states)
        self.num_batched_decodes += len(decode)
        need = [k for k, d in enumerate(decode) if d[3]]
        if not need:
            return
        sel = out[to_device(need, torch.long, out.device)]
        logits = self.model.compute_logits(sel) if self._has_head else sel
        for n, k in enumerate(need):
            parts[decode[k][0]] = logits[n:n + 1]

    def graph_fits(self, plan) -> bool | None:
        if self.decode_graphs is None:
            return None
        states = [self.states[sid] for sid in plan.seq_ids if sid in self.states]
        return self.decode_graphs.fits(len(plan.seq_ids), states)

    @torch.inference_mode()
    def execute(self, out: SchedulerOutput) -> StepResult:
        self._drop_preempted(out)
        return super().execute(out)

    @torch.inference_mode()
    def launch(self, out: SchedulerOutput, pending: PendingStep | None = None) -> PendingStep:
        self._drop_preempted(out)
        return super().launch(out, pending)

    @torch.inference_mode()
    def dummy_step(self) -> None:
        """An idle DP rank's step: no request of its own, throwaway forwards while a peer still
        runs its chunks (its TP workers do the same, told by a "dummy" message)."""
        if self.plan_broadcaster is not None:
            self.plan_broadcaster.dummy()
        self.lockstep.finish()

    def _dummy_forward(self) -> None:
        state = self.model.new_state()  # the pools' spare units (model/v4/cache_pool.py)
        self.model(torch.zeros(1, dtype=torch.long, device=self.device), state)
        state.release()
