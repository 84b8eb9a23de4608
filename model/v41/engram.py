"""Engram: gated n-gram memory written into the residual streams before a layer's mHC.

Hashing (:class:`EngramHasher`, shared by all engram layers, no weights):
1. token ids -> a compressed vocabulary derived from the tokenizer: every token's decoded text
   is NFKC-, NFD-normalized, accent-stripped, lowercased, whitespace runs collapsed to one
   space (a token that is exactly one space stays one) and stripped; tokens that decode to a
   partial UTF-8 sequence keep their raw token string; an empty result keeps the raw text.
   New keys get ids by first occurrence. The count must equal
   ``engram_compressed_vocab_size`` — the hash multipliers derive from it.
2. for each position, the ids at look-back 0..N-1 (N = ``engram_max_ngram_size``; the pad
   id where the look-back passes the sequence start or a DEAD slot) are multiplied by
   per-layer odd multipliers (numpy ``default_rng(10007·layer)``) and XOR-folded; after
   folding n ids the value hashes the n-gram, reduced modulo one prime per (n, head) and
   offset into that layer's table. Primes are drawn upwards from ``engram_vocab_size`` and
   never repeat across layers; offsets restart at 0 per layer.
Lookup (:class:`Engram`): the ``(N-1)·heads`` rows are flattened, ``wkv`` maps them to one
key per stream plus one value; per stream
``gate = sigmoid(signed_sqrt(max(|dot|, 1e-6)))`` with
``dot = ⟨h_k, q_w·k_w·key_k⟩ · rstd(h_k) · rstd(key_k) / √D``, then ``X_k += gate_k · value``.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from model.parallel import ParallelContext
from model.v41.config import V41Config
from model.v41.fp8_linear import fp8_linear
from model.v41.state import DEAD
from model.v4_parallel import first_rows, owned_lookup, vocab_rows

_SPACE_SENTINEL = "\ue000"  # private-use: keeps a lone-space token from stripping to ""


def _is_prime(n: int) -> bool:
    """Deterministic Miller-Rabin for 64-bit integers."""
    if n < 2:
        return False
    small = (2, 3, 5, 7, 11, 13, 17, 19, 23, 29, 31, 37)
    for p in small:
        if n % p == 0:
            return n == p
    d, r = n - 1, 0
    while d % 2 == 0:
        d //= 2
        r += 1
    for a in small:
        x = pow(a, d, n)
        if x in (1, n - 1):
            continue
        for _ in range(r - 1):
            x = x * x % n
            if x == n - 1:
                break
        else:
            return False
    return True


def engram_primes(config: V41Config) -> list[list[list[int]]]:
    """[engram layer][n-gram size - 2][head] table sizes: distinct primes > engram_vocab_size - 1."""
    seen: set[int] = set()
    out = []
    for _ in config.engram_layer_ids:
        per_layer = []
        for _ in range(config.engram_max_ngram_size - 1):
            row, current = [], config.engram_vocab_size - 1
            for _ in range(config.engram_n_heads):
                current += 1
                while not _is_prime(current) or current in seen:
                    current += 1
                seen.add(current)
                row.append(current)
            per_layer.append(row)
        out.append(per_layer)
    return out


def hash_multipliers(layer_ids, max_ngram: int, compressed_vocab: int) -> torch.Tensor:
    """[engram layers, max_ngram] odd int64 multipliers small enough that id·m fits int64."""
    bound = max(1, (np.iinfo(np.int64).max // compressed_vocab) // 2)
    rows = []
    for layer in layer_ids:
        values = np.random.default_rng(10007 * layer).integers(0, bound, size=(max_ngram,), dtype=np.int64)
        rows.append(torch.from_numpy(values * 2 + 1))
    return torch.stack(rows)


def build_compressed_token_map(tokenizer_json_path: str) -> tuple[list[int], int]:
    """Token id -> compressed id from a ``tokenizer.json``; returns (map, compressed vocab size)."""
    from tokenizers import Regex, Tokenizer, normalizers

    tok = Tokenizer.from_file(tokenizer_json_path)
    normalizer = normalizers.Sequence([
        normalizers.NFKC(),
        normalizers.NFD(),
        normalizers.StripAccents(),
        normalizers.Lowercase(),
        normalizers.Replace(Regex(r"[ \t\r\n]+"), " "),
        normalizers.Replace(Regex(r"^ $"), _SPACE_SENTINEL),
        normalizers.Strip(),
        normalizers.Replace(_SPACE_SENTINEL, " "),
    ])
    ids: dict[str, int] = {}
    table = []
    for token_id in range(tok.get_vocab_size(with_added_tokens=True)):
        text = tok.decode([token_id], skip_special_tokens=False)
        if "\ufffd" in text:
            key = tok.id_to_token(token_id)
        else:
            key = normalizer.normalize_str(text) or text
        table.append(ids.setdefault(key, len(ids)))
    return table, len(ids)


def synthetic_compressed_token_map(vocab_size: int, compressed_vocab: int) -> list[int]:
    """Token id -> ``id mod compressed_vocab``: the stand-in for :func:`build_compressed_token_map`
    when a model has random weights and no tokenizer of its own (``--load-format dummy``).
    It covers every compressed id (the hasher checks the count against the config), so random
    prompts hash like real text does, at the same cost."""
    return [i % compressed_vocab for i in range(max(vocab_size, compressed_vocab))]


class EngramHasher:
    """Hash ids of the n-grams ending at each new token; the look-back lives in the request
    state (``engram_history``), so prefill chunks and decode steps hash like one pass."""

    def __init__(self, config: V41Config, token_map: list[int]) -> None:
        self.max_ngram = config.engram_max_ngram_size
        self.token_map = torch.tensor(token_map, dtype=torch.long)
        vocab = int(self.token_map.max()) + 1 if token_map else 0
        if vocab != config.engram_compressed_vocab_size:
            raise ValueError(
                f"tokenizer gives an engram compressed vocabulary of {vocab} ids but the config says "
                f"engram_compressed_vocab_size={config.engram_compressed_vocab_size}: "
                "wrong tokenizer for this checkpoint"
            )
        self.pad_id = token_map[config.engram_pad_id]
        primes = engram_primes(config)
        self.primes = torch.tensor(primes, dtype=torch.long)  # [L, N-1, heads]
        offsets = []
        for layer in primes:
            flat = [p for row in layer for p in row]
            offsets.append([sum(flat[:i]) for i in range(len(flat))])
        self.offsets = torch.tensor(offsets, dtype=torch.long)  # [L, (N-1)*heads]
        self.multipliers = hash_multipliers(config.engram_layer_ids, self.max_ngram, vocab)
        self._device_tables: dict = {}

    def __call__(self, input_ids: torch.Tensor, history: list[int]) -> tuple[torch.Tensor, list[int]]:
        """input_ids [T] -> (hash ids [T, engram layers, (N-1)*heads], new history).

        The look-back ids are gathered on the host in one array pass (a prefill chunk is
        thousands of tokens: a per-element tensor write costs ~30 µs each)."""
        new = self.token_map[input_ids.cpu()].numpy()
        seq = np.concatenate([np.asarray(history, dtype=np.int64), new])
        idx = len(history) + np.arange(len(new))[:, None] - np.arange(self.max_ngram)[None, :]  # [T, N]
        ids = seq[np.maximum(idx, 0)]
        # A look-back stops at the sequence start or a DEAD slot: that shift and all longer are pad.
        stopped = np.logical_or.accumulate((idx < 0) | (ids == DEAD), axis=1)
        tokens = torch.from_numpy(np.where(stopped, self.pad_id, ids))
        tail = seq[-(self.max_ngram - 1):].tolist() if self.max_ngram > 1 else []
        return self._hash(tokens).to(input_ids.device), tail

    def decode_rows(self, input_ids: torch.Tensor, histories: list[list[int]]) -> tuple[torch.Tensor, list[list[int]]]:
        """One new token per request: input_ids [B], each request's history -> (hash ids
        [B, engram layers, (N-1)*heads], the new histories); row b equals
        ``self(input_ids[b:b+1], histories[b])``."""
        new = self.token_map[input_ids.cpu()].tolist()
        tokens = torch.full((len(new), self.max_ngram), self.pad_id, dtype=torch.long)
        out = []
        for b, (token, history) in enumerate(zip(new, histories)):
            seq = history + [token]
            for shift in range(self.max_ngram):
                j = len(seq) - 1 - shift
                if j < 0 or seq[j] == DEAD:
                    break
                tokens[b, shift] = seq[j]
            out.append(seq[-(self.max_ngram - 1):] if self.max_ngram > 1 else [])
        return self._hash(tokens).to(input_ids.device), out

    def hash_sequences(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Whole sequences from their start, on their device: input_ids [B, T] -> hash ids
        [B, T, engram layers, (N-1)*heads], row b equal to ``self(input_ids[b], [])[0]``."""
        device = input_ids.device
        mapped = self._tables(device)[0][input_ids]
        tokens = torch.full((*input_ids.shape, self.max_ngram), self.pad_id, dtype=torch.long, device=device)
        for shift in range(self.max_ngram):
            tokens[:, shift:, shift] = mapped[:, : mapped.shape[1] - shift]
        return self._hash(tokens)

    def _hash(self, tokens: torch.Tensor) -> torch.Tensor:
        """Look-back ids [..., N] -> hash ids [..., L, (N-1)*heads], on ``tokens``' device."""
        _, multipliers, primes, offsets = self._tables(tokens.device)
        products = tokens.unsqueeze(-2) * multipliers  # [..., L, N]
        rolling, hashes = products[..., 0], []
        for n in range(1, self.max_ngram):
            rolling = torch.bitwise_xor(rolling, products[..., n])
            hashes.append(rolling.unsqueeze(-1) % primes[:, n - 1])
        return torch.cat(hashes, dim=-1) + offsets

    def _tables(self, device) -> tuple[torch.Tensor, ...]:
        """(token map, multipliers, primes, offsets) on ``device``, copied there once."""
        key = str(device)
        if key not in self._device_tables:
            self._device_tables[key] = tuple(
                t.to(device) for t in (self.token_map, self.multipliers, self.primes, self.offsets))
        return self._device_tables[key]


class EngramEmbedding(nn.Module):
    """The hash table: rows of stored values with one scale per ``block`` channels.

    The checkpoint stores FP8 rows plus E8M0 scales; the row is ``value · scale`` per block.
    ``weight`` may hold the FP8 values themselves or the same values in a float dtype (the
    loader delivers values and scales unmultiplied); a float checkpoint has unit scales.
    Under TP a rank holds its vocab-parallel rows and returns zeros for the others' ids.
    """

    def __init__(self, rows: int, dim: int, dtype: torch.dtype, block: int = 32,
                 par: ParallelContext | None = None) -> None:
        super().__init__()
        par = par or ParallelContext()
        self.block = min(block, dim)
        self.start, local = vocab_rows(rows, par) if par.tp_size > 1 else (0, rows)
        self.vocab_parallel = par.tp_size > 1
        self.weight = nn.Parameter(torch.empty(local, dim, dtype=dtype))
        self.scale = nn.Parameter(torch.ones(local, dim // self.block, dtype=torch.float32))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        owned = None
        if self.vocab_parallel:
            ids, owned = owned_lookup(ids, self.start, self.weight.shape[0])
        values = F.embedding(ids, self.weight).float().unflatten(-1, (-1, self.block))
        scales = F.embedding(ids, self.scale).float()
        out = (values * scales.unsqueeze(-1)).flatten(-2)
        return out if owned is None else out * owned.unsqueeze(-1)


class Engram(nn.Module):
    def __init__(self, config: V41Config, layer_idx: int, dtype: torch.dtype,
                 par: ParallelContext | None = None, mxfp8: bool = False) -> None:
        """``mxfp8``: ``wkv`` (FP8 in the checkpoint) as stored, run as MXFP8 (model/v41/fp8_linear.py)."""
        super().__init__()
        c = config
        self.par = par = par or ParallelContext()
        self.table_index = c.engram_layer_ids.index(layer_idx)
        self.hidden = c.hidden_size
        self.hc = c.hc_mult
        self.eps = c.rms_norm_eps
        cols = (c.engram_max_ngram_size - 1) * c.engram_n_heads
        self.embed = EngramEmbedding(c.engram_num_embeddings[self.table_index], c.engram_head_dim, dtype, par=par)
        self.dtype = dtype
        self.wkv = fp8_linear(cols * c.engram_head_dim, c.hidden_size * (c.hc_mult + 1), dtype, mxfp8)
        self.q_weight = nn.Parameter(torch.ones(c.hc_mult, c.hidden_size, dtype=dtype))
        self.k_weight = nn.Parameter(torch.ones(c.hc_mult, c.hidden_size, dtype=dtype))

    def forward(self, streams: torch.Tensor, hash_ids: torch.Tensor) -> torch.Tensor:
        """streams [T, hc, D], hash_ids [T, cols] (this layer's) -> updated streams. Under TP,
        ``hash_ids`` are the step's n valid rows and ``streams`` this rank's rows: the partial
        lookups are reduced to this rank's rows first (model/v4_parallel.py)."""
        rows = self.embed(hash_ids)
        if self.par.tp_size > 1:
            rows = first_rows(self.par, hash_ids.shape[0])(rows)
        kv = self.wkv(rows.flatten(-2).to(self.dtype))
        key, value = kv.split([self.hc * self.hidden, self.hidden], dim=-1)
        key = key.float().unflatten(-1, (self.hc, self.hidden))
        weight = self.q_weight.float() * self.k_weight.float()
        h = streams.float()
        rstd = torch.rsqrt(h.square().mean(-1) + self.eps) * torch.rsqrt(key.square().mean(-1) + self.eps)
        dot = (h * weight * key).sum(-1) * rstd * self.hidden**-0.5
        gate = torch.sigmoid(torch.copysign(dot.abs().clamp_min(1e-6).sqrt(), dot))
        return (h + gate.unsqueeze(-1) * value.float().unsqueeze(-2)).to(streams.dtype)
