"""Turn a batch of logits into next tokens, with vLLM's sampling semantics.

Processing order (vLLM v1's):
1. Logprobs to report are the log_softmax of the *raw* model logits, before any penalty,
   temperature or filter (vLLM's default ``logprobs_mode="raw_logprobs"``).
2. min_tokens: while a row has fewer than ``min_tokens`` outputs, its EOS ids and
   ``stop_token_ids`` are masked (EOS is masked even with ``ignore_eos``).
3. Penalties: repetition (tokens of prompt + output; positive logits divided, negative
   multiplied), then frequency and presence (output tokens only).
4. Greedy rows (temperature < 1e-5) take the argmax of the penalized logits.
5. Other rows: temperature, min_p, top_k, top_p (vLLM applies min_p, an argmax-invariant
   processor, before top-k/top-p), then a draw from the remaining distribution.

Draws use the exponential-race trick: token = argmax(p / E) with E ~ Exp(1) i.i.d.; this
selects token i with probability p_i. A seeded row draws its E from its own generator over
exactly its own vocab row, so its token depends only on its logits and its seed, never on
which other requests share the batch. Everything else is vectorized over the batch.

Choosing tokens never reads the device (no sync), so async scheduling can launch the next step
before these tokens are known: every branch depends on the requests' parameters only. A
top-k row (with or without top-p) is cut among its row's ``max top_k`` best logits (``topk``);
a top-p row without top-k among its fully sorted row (a cut among a few candidates would need a
host-side check that they hold the top-p mass). The parameters' device tensors are built once
per batch composition (:class:`_BatchParams`), in one upload.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

import numpy as np
import torch

from model.upload import to_device, upload_arrays
from server.outputs import TokenLogprob
from server.sampling_params import SamplingParams

# Smallest exponential noise we let through: E == 0 would turn p / E into inf or nan.
_MIN_NOISE = 1e-20


@dataclass(slots=True)
class SamplingRow:
    """One sequence of the batch."""

    params: SamplingParams
    prompt_token_ids: list[int]
    output_token_ids: list[int]  # generated so far (penalties, min_tokens)
    generator: torch.Generator | None = None  # per-request seeded generator; None: global
    eos_token_ids: list[int] | tuple[int, ...] = ()
    num_pending_outputs: int = 0  # outputs still in flight on the device (async): counted, not known

    @property
    def num_outputs(self) -> int:
        return len(self.output_token_ids) + self.num_pending_outputs


@dataclass
class SampleResult:
    token_ids: list[int]
    logprobs: list[TokenLogprob | None]  # None where params.logprobs is None


def make_request_generator(seed: int | None, device) -> torch.Generator | None:
    """A generator for a request with ``seed`` (None: the request uses the global one)."""
    if seed is None:
        return None
    gen = torch.Generator(device=torch.device(device))
    gen.manual_seed(int(seed) & 0xFFFF_FFFF_FFFF_FFFF)
    return gen


def _token_logprobs(logprobs: torch.Tensor, token_ids: torch.Tensor, num_top: list[int]) -> list[TokenLogprob]:
    """TokenLogprob per row of ``logprobs`` [N, V] for ``token_ids`` [N]: the token's logprob,
    its rank (as vLLM: how many tokens are at least as likely, so 1 = the most likely) and
    the ``num_top[i]`` best."""
    chosen = logprobs.gather(1, token_ids.view(-1, 1))
    ranks = (logprobs >= chosen).sum(dim=1)
    k = max(num_top, default=0)
    if k > 0:
        top_vals, top_ids = logprobs.topk(k, dim=1)
        top_vals, top_ids = top_vals.tolist(), top_ids.tolist()
    out = []
    for i, (tid, lp, rank) in enumerate(zip(token_ids.tolist(), chosen.view(-1).tolist(), ranks.tolist())):
        top = {} if num_top[i] == 0 else dict(zip(top_ids[i][:num_top[i]], top_vals[i][:num_top[i]]))
        top[tid] = lp
        out.append(TokenLogprob(token_id=tid, logprob=lp, rank=rank, top=top))
    return out


def compute_prompt_logprobs(logits: torch.Tensor, next_token_ids: list[int], num_top: int) -> list[TokenLogprob]:
    """Logprobs of the actual next prompt token at each position: ``logits`` [P, V] are the
    model outputs at prompt positions, ``next_token_ids[j]`` the token that followed position j."""
    if logits.shape[0] != len(next_token_ids):
        raise ValueError(f"{logits.shape[0]} logit rows for {len(next_token_ids)} next tokens")
    if not next_token_ids:
        return []
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    ids = torch.tensor(next_token_ids, dtype=torch.long, device=logits.device)
    return _token_logprobs(logprobs, ids, [num_top] * len(next_token_ids))


def _flatten_ids(lists: list[list[int]], vocab: int) -> tuple[np.ndarray, np.ndarray]:
    """Concatenate token id lists (numpy: several times faster than torch.tensor(list)) and
    return (ids, row index of each id), refusing ids outside the vocabulary."""
    lengths = np.fromiter(map(len, lists), dtype=np.int64, count=len(lists))
    ids = np.fromiter(itertools.chain.from_iterable(lists), dtype=np.int64, count=int(lengths.sum()))
    if ids.size and (ids.min() < 0 or ids.max() >= vocab):
        raise ValueError(f"token id out of range for a vocabulary of {vocab} logits")
    return ids, np.repeat(np.arange(len(lists), dtype=np.int64), lengths)


def _to_device(*arrays: np.ndarray, device) -> list[torch.Tensor]:
    return [torch.from_numpy(a).to(device, non_blocking=True) for a in arrays]


class PromptTokenCache:
    """Distinct prompt token ids of each row, on the device, for the repetition penalty.

    A prompt never changes while its request runs, so it is converted once rather than at
    every step. Entries live as long as their row keeps appearing in consecutive batches;
    holding the list itself keeps its ``id`` from being reused by another list meanwhile.
    """

    def __init__(self) -> None:
        self._entries: dict[int, tuple[list[int], int, torch.Tensor]] = {}

    def lookup(self, prompts: list[list[int]], vocab: int, device) -> list[torch.Tensor]:
        kept: dict[int, tuple[list[int], int, torch.Tensor]] = {}
        out = []
        for prompt in prompts:
            entry = self._entries.get(id(prompt)) or kept.get(id(prompt))
            if entry is None or entry[0] is not prompt or entry[1] != len(prompt) or entry[2].device != device:
                ids, _ = _flatten_ids([prompt], vocab)
                entry = (prompt, len(prompt), _to_device(np.unique(ids), device=device)[0])
            kept[id(prompt)] = entry
            out.append(entry[2])
        self._entries = kept
        return out


def apply_logit_bias(logits: torch.Tensor, rows: list[SamplingRow]) -> None:
    """Add each request's ``logit_bias`` to its row (OpenAI semantics; before penalties and
    temperature, as vLLM's logits processor does). Reported logprobs stay the raw model's."""
    for i, r in enumerate(rows):
        bias = r.params.logit_bias
        if bias:
            ids = to_device(list(bias.keys()), torch.long, logits.device)
            vals = to_device(list(bias.values()), logits.dtype, logits.device)
            logits[i].index_add_(0, ids, vals)


def apply_min_tokens(logits: torch.Tensor, rows: list[SamplingRow]) -> None:
    """Mask EOS and stop token ids (in place) for rows still short of ``min_tokens``."""
    idx_rows, idx_toks = [], []
    vocab = logits.shape[1]
    for i, row in enumerate(rows):
        if row.num_outputs < row.params.min_tokens:
            for t in (*row.eos_token_ids, *row.params.stop_token_ids):
                if 0 <= t < vocab:
                    idx_rows.append(i)
                    idx_toks.append(t)
    if idx_rows:
        dev = logits.device
        logits[to_device(idx_rows, torch.long, dev), to_device(idx_toks, torch.long, dev)] = float("-inf")


def apply_penalties(logits: torch.Tensor, rows: list[SamplingRow],
                    prompt_cache: PromptTokenCache | None = None) -> None:
    """Repetition, frequency and presence penalties, in place, on the rows that ask for them."""
    vocab, dev = logits.shape[1], logits.device
    sel = [i for i, r in enumerate(rows) if r.params.repetition_penalty != 1.0
           or r.params.frequency_penalty != 0.0 or r.params.presence_penalty != 0.0]
    if not sel:
        return
    params = [rows[i].params for i in sel]
    out_ids, out_rows = _to_device(*_flatten_ids([rows[i].output_token_ids for i in sel], vocab), device=dev)
    counts = torch.zeros(len(sel), vocab, dtype=torch.float32, device=dev)
    counts.index_put_((out_rows, out_ids), torch.ones(out_ids.numel(), device=dev), accumulate=True)
    idx = torch.tensor(sel, device=dev)
    sub = logits[idx]

    rep = [j for j, p in enumerate(params) if p.repetition_penalty != 1.0]
    if rep:
        seen = counts > 0
        prompts = [rows[sel[j]].prompt_token_ids for j in rep]
        prompt_ids = (prompt_cache or PromptTokenCache()).lookup(prompts, vocab, dev)
        lengths = torch.tensor([t.numel() for t in prompt_ids], device=dev)
        prompt_rows = torch.repeat_interleave(torch.tensor(rep, device=dev), lengths)
        seen[prompt_rows, torch.cat(prompt_ids)] = True
        penalty = torch.tensor([p.repetition_penalty for p in params], device=dev).view(-1, 1)
        sub = torch.where(seen, torch.where(sub > 0, sub / penalty, sub * penalty), sub)

    freq = torch.tensor([p.frequency_penalty for p in params], device=dev).view(-1, 1)
    presence = torch.tensor([p.presence_penalty for p in params], device=dev).view(-1, 1)
    sub -= freq * counts + presence * (counts > 0).float()
    logits[idx] = sub


class _Uploads:
    """Host arrays collected under names, then copied to the device together (one upload)."""

    def __init__(self) -> None:
        self.names: list[str] = []
        self.arrays: list[np.ndarray] = []

    def add(self, name: str, values, dtype) -> None:
        self.names.append(name)
        self.arrays.append(np.asarray(values, dtype=dtype))

    def upload(self, device) -> dict[str, torch.Tensor]:
        return dict(zip(self.names, upload_arrays(self.arrays, device)))


@dataclass
class _Filters:
    """min_p, then top-k, then top-p of R rows: which rows take which path (host lists, from the
    parameters) and, in ``t`` once uploaded, their values on the device."""

    num_rows: int
    use_min_p: bool
    topk: list[int]  # rows with top-k (< vocab): cut among their ``topk_max`` best logits
    topk_max: int
    topk_has_p: bool  # some top-k row also has top-p
    sort: list[int]  # rows with top-p only: cut over the whole sorted row
    t: dict[str, torch.Tensor] = field(default_factory=dict)

    @classmethod
    def plan(cls, uploads: _Uploads, min_p: list[float], top_k: list[int], top_p: list[float],
             vocab: int) -> "_Filters":
        n = len(min_p)
        k = [x if 0 < x < vocab else vocab for x in top_k]
        topk = [i for i in range(n) if k[i] < vocab]
        sort = [i for i in range(n) if k[i] >= vocab and top_p[i] < 1.0]
        f = cls(n, any(m > 0 for m in min_p), topk, max((k[i] for i in topk), default=0),
                any(top_p[i] < 1.0 for i in topk), sort)
        if f.use_min_p:
            uploads.add("min_p", min_p, np.float32)
        if topk:
            if len(topk) < n:
                uploads.add("topk_idx", topk, np.int64)
            uploads.add("topk_k", [k[i] for i in topk], np.int64)
            if f.topk_has_p:
                uploads.add("topk_p", [top_p[i] for i in topk], np.float32)
        if sort:
            if len(sort) < n:
                uploads.add("sort_idx", sort, np.int64)
            uploads.add("sort_p", [top_p[i] for i in sort], np.float32)
        return f

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        """Mask (to -inf) what the filters exclude; ``logits`` [R, V] is left as it was."""
        t = self.t
        if self.use_min_p:
            probs = torch.softmax(logits, dim=-1)
            threshold = t["min_p"].view(-1, 1) * probs.max(dim=-1, keepdim=True).values
            logits = logits.masked_fill(probs < threshold, float("-inf"))
        cuts = []
        if self.topk:
            sub = logits if len(self.topk) == self.num_rows else logits[t["topk_idx"]]
            best = sub.topk(self.topk_max, dim=-1).values
            cuts.append(("topk_idx", _cut(best, t["topk_k"].view(-1, 1), t["topk_p"].view(-1, 1)
                                          if self.topk_has_p else None)))
        if self.sort:
            sub = logits if len(self.sort) == self.num_rows else logits[t["sort_idx"]]
            cuts.append(("sort_idx", _cut(sub.sort(dim=-1, descending=True).values, None, t["sort_p"].view(-1, 1))))
        if not cuts:
            return logits
        if len(cuts) == 1 and cuts[0][0] not in t:  # one path covers every row
            threshold = cuts[0][1]
        else:
            threshold = torch.full((self.num_rows, 1), float("-inf"), device=logits.device, dtype=logits.dtype)
            for name, cut in cuts:
                threshold[t[name]] = cut
        return logits.masked_fill(logits < threshold, float("-inf"))


def filter_logits(logits: torch.Tensor, min_p: list[float], top_k: list[int], top_p: list[float]) -> torch.Tensor:
    """Mask (to -inf) what min_p, then top_k, then top_p exclude, per row of ``logits`` [R, V]
    (already divided by temperature). ``top_k`` 0, ``top_p`` 1 and ``min_p`` 0 disable.

    Ties at a top-k or top-p boundary are kept (each cut is a logit threshold)."""
    uploads = _Uploads()
    f = _Filters.plan(uploads, min_p, top_k, top_p, logits.shape[1])
    f.t = uploads.upload(logits.device)
    return f.apply(logits)


def _cut(sorted_vals: torch.Tensor, k: torch.Tensor | None, top_p: torch.Tensor | None) -> torch.Tensor:
    """Per-row logit threshold for top-k then top-p, from the row's best logits sorted
    descending: all of them (``k`` None) or at least its top-k."""
    if top_p is None:  # top-k alone: the k-th best logit
        return sorted_vals.gather(1, k - 1)
    vals = sorted_vals
    if k is not None:
        in_k = torch.arange(sorted_vals.shape[1], device=sorted_vals.device).view(1, -1) < k
        vals = sorted_vals.masked_fill(~in_k, float("-inf"))
    probs = torch.exp(vals - torch.logsumexp(vals, dim=-1, keepdim=True))  # renormalized over the top-k
    # The top-p set is the shortest prefix whose mass reaches top_p: position j stays while
    # the mass strictly before it is below top_p.
    mass_before = probs.cumsum(dim=-1) - probs
    keep = (mass_before < top_p) | (top_p >= 1.0)
    if k is not None:
        keep &= in_k
    keep[:, 0] = True
    return sorted_vals.gather(1, keep.sum(dim=-1, keepdim=True) - 1)


@dataclass
class _BatchParams:
    """What a batch's sampling parameters decide (one per batch composition): which rows
    draw, their temperatures and filters on the device, and whether any row needs the
    logits-modifying processors (logit bias, min_tokens, penalties)."""

    params: list[SamplingParams]  # the key: equal parameters in the same order share it
    vocab: int
    device: torch.device
    random: list[int]  # rows that draw (the others are greedy)
    modifies: bool
    filters: _Filters | None = None
    t: dict[str, torch.Tensor] = field(default_factory=dict)

    @classmethod
    def build(cls, params: list[SamplingParams], vocab: int, device: torch.device) -> "_BatchParams":
        random = [i for i, p in enumerate(params) if not p.greedy]
        modifies = any(p.logit_bias or p.min_tokens or p.repetition_penalty != 1.0 or p.frequency_penalty != 0.0
                       or p.presence_penalty != 0.0 for p in params)
        bp = cls(params, vocab, device, random, modifies)
        if random:
            uploads = _Uploads()
            if len(random) < len(params):
                uploads.add("random_idx", random, np.int64)
            drawn = [params[i] for i in random]
            uploads.add("temperature", [p.temperature for p in drawn], np.float32)
            bp.filters = _Filters.plan(uploads, [p.min_p for p in drawn], [p.top_k for p in drawn],
                                       [p.top_p for p in drawn], vocab)
            bp.t = bp.filters.t = uploads.upload(device)
        return bp


class Sampler:
    """Samples one token per row; unseeded rows share a generator seeded with ``global_seed``."""

    def __init__(self, global_seed: int = 0):
        self.global_seed = global_seed
        self._generators: dict[torch.device, torch.Generator] = {}
        self._prompt_cache = PromptTokenCache()
        self._last_batch: _BatchParams | None = None

    def _global_generator(self, device: torch.device) -> torch.Generator:
        gen = self._generators.get(device)
        if gen is None:
            gen = torch.Generator(device=device)
            gen.manual_seed(self.global_seed)
            self._generators[device] = gen
        return gen

    def __call__(self, logits: torch.Tensor, rows: list[SamplingRow]) -> SampleResult:
        token_ids = self.sample_tokens(logits, rows)  # checks the shape; leaves ``logits`` as it was
        dev = logits.device
        want_lp = [i for i, r in enumerate(rows) if r.params.logprobs is not None]
        raw_logprobs = torch.log_softmax(logits[want_lp].float(), dim=-1) if want_lp else None

        logprobs: list[TokenLogprob | None] = [None] * len(rows)
        if want_lp:
            chosen = token_ids[torch.tensor(want_lp, device=dev)]
            entries = _token_logprobs(raw_logprobs, chosen, [rows[i].params.logprobs for i in want_lp])
            for i, entry in zip(want_lp, entries):
                logprobs[i] = entry
        return SampleResult(token_ids=token_ids.tolist(), logprobs=logprobs)

    def _batch_params(self, rows: list[SamplingRow], vocab: int, device: torch.device) -> _BatchParams:
        params = [r.params for r in rows]
        bp = self._last_batch
        if bp is None or bp.vocab != vocab or bp.device != device or bp.params != params:
            bp = self._last_batch = _BatchParams.build(params, vocab, device)
        return bp

    def sample_tokens(self, logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
        """The chosen token of every row, as a tensor on the logits' device. Reads nothing back
        to the host, so the next step can be launched before these tokens are known (async
        scheduling); ``logits`` is left as it was."""
        if logits.dim() != 2 or logits.shape[0] != len(rows):
            raise ValueError(f"logits must be [num_rows={len(rows)}, vocab], got {tuple(logits.shape)}")
        bp = self._batch_params(rows, logits.shape[1], logits.device)
        logits = logits.float()
        if bp.modifies:
            logits = logits.clone()
            apply_logit_bias(logits, rows)
            apply_min_tokens(logits, rows)
            apply_penalties(logits, rows, self._prompt_cache)
        if not bp.random:
            return logits.argmax(dim=-1)
        drawn = self._sample(logits, rows, bp)
        if "random_idx" not in bp.t:
            return drawn
        token_ids = logits.argmax(dim=-1)
        token_ids[bp.t["random_idx"]] = drawn
        return token_ids

    def _sample(self, logits: torch.Tensor, rows: list[SamplingRow], bp: _BatchParams) -> torch.Tensor:
        dev = logits.device
        sel = bp.random
        x = logits[bp.t["random_idx"]] if "random_idx" in bp.t else logits
        x = bp.filters.apply(x / bp.t["temperature"].view(-1, 1))
        probs = torch.softmax(x, dim=-1)
        noise = torch.empty_like(probs)
        unseeded = [j for j, i in enumerate(sel) if rows[i].generator is None]
        if len(unseeded) == len(sel):
            noise.exponential_(generator=self._global_generator(dev))
        else:
            if unseeded:
                idx = to_device(unseeded, torch.long, dev)
                noise[idx] = torch.empty(len(unseeded), probs.shape[1], device=dev).exponential_(
                    generator=self._global_generator(dev))
            for j, i in enumerate(sel):
                if rows[i].generator is not None:
                    noise[j].exponential_(generator=rows[i].generator)
        return (probs / noise.clamp_min_(_MIN_NOISE)).argmax(dim=-1)
