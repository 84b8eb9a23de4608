"""The decimal-addition task of the bundled model: data, held-out split, tokenizer, scoring.

Shared by ``train_arith.py``, ``eval_arith.py``, ``make_arith_tasks.py`` and the tests, so the
held-out rule and the prompt format are written down exactly once.

Task: the prompt ``"{a}+{b}="`` (0 <= a, b <= 999, no spaces; the tokenizer prepends BOS) is
answered with ``"{a+b}\\n"`` followed by EOS. Pairs with ``(a*1000 + b) % 97 == 0`` (10,310 of
the 1,000,000) are held out: training never samples them, every evaluation draws from them.
"""

from __future__ import annotations

import json
import os
from typing import Iterable, Sequence

import numpy as np

BOS = "<｜begin▁of▁sentence｜>"
EOS = "<｜end▁of▁sentence｜>"
UNK = "<unk>"
SPECIAL_TOKENS = (BOS, EOS, UNK)  # ids 0, 1, 2 (DeepSeek's BOS/EOS ids)
CHARS = "0123456789+=\n"  # ids 3..15, one token per character
MAX_OPERAND = 999
HELDOUT_MODULUS = 97
MODEL_MAX_LENGTH = 512  # = max_position_embeddings of the bundled config
# The fixed order in which evaluations draw held-out pairs; independent of any training seed.
HELDOUT_ORDER_SEED = 20261129

CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}{% if message['role'] != 'system' %}"
    "{{ message['content'] }}{% endif %}{% endfor %}"
)


def prompt_text(a: int, b: int) -> str:
    return f"{a}+{b}="


def answer_text(a: int, b: int) -> str:
    return f"{a + b}\n"


def is_held_out(a, b):
    """True for held-out pairs; works on ints and on numpy arrays alike."""
    return (a * 1000 + b) % HELDOUT_MODULUS == 0


def held_out_pairs(n: int | None = None) -> list[tuple[int, int]]:
    """The first ``n`` held-out pairs (all of them if None) in a fixed shuffled order."""
    codes = np.arange(0, (MAX_OPERAND + 1) * 1000, HELDOUT_MODULUS)
    order = np.random.default_rng(HELDOUT_ORDER_SEED).permutation(len(codes))
    codes = codes[order]
    if n is not None:
        if n > len(codes):
            raise ValueError(f"only {len(codes)} held-out pairs exist, asked for {n}")
        codes = codes[:n]
    return [(int(c) // 1000, int(c) % 1000) for c in codes]


def _sample_operands(rng: np.random.Generator, n: int) -> np.ndarray:
    """Operands: 3/4 uniform on [0, 999], 1/4 with a uniformly drawn digit count (1-3).

    Uniform pairs are 81 % three-digit numbers; the length-stratified quarter makes short
    operands such as ``12+30=`` common enough to be learned as well as long ones.
    """
    uniform = rng.integers(0, MAX_OPERAND + 1, size=n)
    digits = rng.integers(1, 4, size=n)
    low = np.where(digits == 1, 0, 10 ** (digits - 1))
    stratified = low + (rng.random(n) * (10**digits - low)).astype(np.int64)
    return np.where(rng.random(n) < 0.75, uniform, stratified)


def sample_training_pairs(rng: np.random.Generator, n: int) -> tuple[np.ndarray, np.ndarray]:
    """``n`` fresh random pairs, none of them held out."""
    a = _sample_operands(rng, n)
    b = _sample_operands(rng, n)
    bad = is_held_out(a, b)
    while bad.any():
        k = int(bad.sum())
        a[bad] = _sample_operands(rng, k)
        b[bad] = _sample_operands(rng, k)
        bad = is_held_out(a, b)
    return a, b


# ---- tokenizer ---------------------------------------------------------------------------


def build_tokenizer():
    """A character-level ``tokenizers`` tokenizer: every character is one token, BOS prepended.

    Unknown characters become ``<unk>``; the Fuse decoder joins tokens without spaces.
    """
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, pre_tokenizers, processors
    from tokenizers.models import WordLevel

    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS + tuple(CHARS))}
    tok = Tokenizer(WordLevel(vocab, unk_token=UNK))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    tok.decoder = decoders.Fuse()
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, vocab[BOS])]
    )
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS])
    return tok


def tokenizer_config() -> dict:
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "add_bos_token": True,
        "add_eos_token": False,
        "bos_token": BOS,
        "eos_token": EOS,
        "pad_token": EOS,
        "unk_token": UNK,
        "model_max_length": MODEL_MAX_LENGTH,
        "clean_up_tokenization_spaces": False,
        "chat_template": CHAT_TEMPLATE,
    }


def write_tokenizer_files(out_dir: str) -> None:
    os.makedirs(out_dir, exist_ok=True)
    build_tokenizer().save(os.path.join(out_dir, "tokenizer.json"))
    with open(os.path.join(out_dir, "tokenizer_config.json"), "w", encoding="utf-8") as f:
        json.dump(tokenizer_config(), f, indent=2, ensure_ascii=False)
        f.write("\n")


# ---- batches and scoring -----------------------------------------------------------------


def encode_training_batch(tok, a: Sequence[int], b: Sequence[int], without_bos=None):
    """input_ids and labels (``-100`` outside answer, "\\n" and EOS), right-padded with EOS.

    Rows flagged in ``without_bos`` drop the leading BOS: clients that tokenize on their own
    (lm-eval's remote tokenizer, ``add_special_tokens=False``) send prompts without it, and the
    model should answer those too.
    """
    import torch

    eos = tok.token_to_id(EOS)
    prompts = tok.encode_batch([prompt_text(x, y) for x, y in zip(a, b)])
    answers = tok.encode_batch(
        [answer_text(x, y) for x, y in zip(a, b)], add_special_tokens=False
    )
    if without_bos is None:
        without_bos = [False] * len(prompts)
    rows = [
        (p.ids[1:] if drop else p.ids, q.ids + [eos])
        for p, q, drop in zip(prompts, answers, without_bos)
    ]
    width = max(len(p) + len(q) for p, q in rows)
    ids = np.full((len(rows), width), eos, dtype=np.int64)
    labels = np.full((len(rows), width), -100, dtype=np.int64)
    for i, (p, q) in enumerate(rows):
        ids[i, : len(p) + len(q)] = p + q
        labels[i, len(p) : len(p) + len(q)] = q
    return torch.from_numpy(ids), torch.from_numpy(labels)


def greedy_exact_match(
    model,
    tok,
    pairs: Iterable[tuple[int, int]],
    device="cpu",
    batch_size: int = 1024,
    with_bos: bool = True,
) -> tuple[float, list[tuple[int, int, str]]]:
    """Fraction of pairs whose greedy continuation is exactly ``"{a+b}\\n"`` then EOS.

    Prompts are grouped by token length so no padding (and no attention mask) is needed.
    Returns the accuracy and the failures as ``(a, b, generated_text)``.
    """
    import torch

    pairs = list(pairs)
    if not pairs:
        raise ValueError("no pairs to evaluate")
    eos = tok.token_to_id(EOS)
    by_len: dict[int, list[tuple[list[int], list[int], tuple[int, int]]]] = {}
    for a, b in pairs:
        p = tok.encode(prompt_text(a, b), add_special_tokens=with_bos).ids
        want = tok.encode(answer_text(a, b), add_special_tokens=False).ids + [eos]
        by_len.setdefault(len(p), []).append((p, want, (a, b)))
    correct = 0
    failures = []
    was_training = model.training
    model.eval()
    with torch.no_grad():
        for group in by_len.values():
            for start in range(0, len(group), batch_size):
                chunk = group[start : start + batch_size]
                ids = torch.tensor([p for p, _, _ in chunk], device=device)
                steps = max(len(w) for _, w, _ in chunk)
                for _ in range(steps):
                    logits = model(input_ids=ids, use_cache=False).logits[:, -1, :]
                    ids = torch.cat([ids, logits.argmax(-1, keepdim=True)], dim=1)
                gen = ids[:, len(chunk[0][0]) :].tolist()
                for g, (_, want, ab) in zip(gen, chunk):
                    if g[: len(want)] == want:
                        correct += 1
                    else:
                        failures.append((*ab, tok.decode(g, skip_special_tokens=False)))
    model.train(was_training)
    return correct / len(pairs), failures


# ---- few-shot prompts (the V4.1 model: prompts longer than its sliding window) ------------

# Fixed draw of the preambles evaluations put in front of held-out pairs.
FEWSHOT_ORDER_SEED = 20261201


def fewshot_text(shots: Sequence[tuple[int, int]], a: int, b: int) -> str:
    """Earlier solved sums, one per line, then the question: ``"12+30=42\\n7+5=12\\n{a}+{b}="``."""
    return "".join(prompt_text(x, y) + answer_text(x, y) for x, y in shots) + prompt_text(a, b)


def sample_fewshot_rows(rng: np.random.Generator, n: int, fewshot_fraction: float, min_shots: int,
                        max_shots: int) -> list[tuple[list[tuple[int, int]], int, int]]:
    """``n`` training rows ``(shots, a, b)``: a ``fewshot_fraction`` share has a preamble of
    ``min_shots``..``max_shots`` solved sums; every pair (shots included) is a training pair."""
    k = np.where(rng.random(n) < fewshot_fraction, rng.integers(min_shots, max_shots + 1, size=n), 0)
    a, b = sample_training_pairs(rng, n + int(k.sum()))
    pairs = list(zip(a.tolist(), b.tolist()))
    rows, used = [], n
    for i in range(n):
        rows.append((pairs[used : used + int(k[i])], pairs[i][0], pairs[i][1]))
        used += int(k[i])
    return rows


def held_out_fewshot_rows(n: int, min_shots: int = 2, max_shots: int = 5):
    """The first ``n`` held-out pairs, each behind a fixed preamble of training pairs."""
    rng = np.random.default_rng(FEWSHOT_ORDER_SEED)
    rows = []
    for a, b in held_out_pairs(n):
        k = int(rng.integers(min_shots, max_shots + 1))
        x, y = sample_training_pairs(rng, k)
        rows.append((list(zip(x.tolist(), y.tolist())), a, b))
    return rows


def fewshot_max_tokens(max_shots: int) -> int:
    """Longest training sequence: BOS, ``max_shots + 1`` sums "999+999=1998\n", EOS."""
    longest = prompt_text(MAX_OPERAND, MAX_OPERAND) + answer_text(MAX_OPERAND, MAX_OPERAND)
    return 2 + (max_shots + 1) * len(longest)


def encode_fewshot_batch(tok, rows, without_bos=None, width: int | None = None):
    """input_ids and labels [B, T] for ``(shots, a, b)`` rows, right-padded with EOS to
    ``width`` (default: the longest row; a fixed width keeps every batch one shape).

    Labels (``-100`` elsewhere) cover every answer's digits and "\n" (the preamble's too: each
    is a solved sum) and the EOS after the last one. Rows flagged in ``without_bos`` drop BOS.
    """
    import torch

    eos = tok.token_to_id(EOS)
    char_id = {c: tok.token_to_id(c) for c in CHARS}  # one token per character, as tok.encode
    encoded = []
    for i, (shots, a, b) in enumerate(rows):
        ids = [] if without_bos is not None and without_bos[i] else [tok.token_to_id(BOS)]
        labels = [-100] * len(ids)
        for x, y in list(shots) + [(a, b)]:
            p = [char_id[c] for c in prompt_text(x, y)]
            q = [char_id[c] for c in answer_text(x, y)]
            ids += p + q
            labels += [-100] * len(p) + q
        ids.append(eos)
        labels.append(eos)
        encoded.append((ids, labels))
    longest = max(len(i) for i, _ in encoded)
    width = longest if width is None else width
    if longest > width:
        raise ValueError(f"a row has {longest} tokens, more than the batch width {width}")
    out_ids = np.full((len(rows), width), eos, dtype=np.int64)
    out_labels = np.full((len(rows), width), -100, dtype=np.int64)
    for r, (ids, labels) in enumerate(encoded):
        out_ids[r, : len(ids)] = ids
        out_labels[r, : len(labels)] = labels
    return torch.from_numpy(out_ids), torch.from_numpy(out_labels)


def greedy_exact_match_logits(logits_fn, tok, rows, device="cpu", batch_size: int = 1024,
                              with_bos: bool = True) -> tuple[float, list[tuple[str, str]]]:
    """Like :func:`greedy_exact_match` for few-shot ``(shots, a, b)`` rows and a causal model
    given as ``logits_fn(input_ids [B, T]) -> logits [B, T, vocab]``. Prompts are right-padded
    to one width (causal: the padding after a row's tokens changes nothing before it). Scored
    teacher-forced in one forward over prompt + expected answer: greedy decoding reproduces
    the answer exactly when every argmax along it is the answer's next token; only the failing
    rows then decode greedily, for their text. Returns the accuracy and the failures as
    ``(prompt, generated_text)``."""
    import torch

    rows = list(rows)
    if not rows:
        raise ValueError("no rows to evaluate")
    eos = tok.token_to_id(EOS)
    items = []
    for shots, a, b in rows:
        text = fewshot_text(shots, a, b)
        want = tok.encode(answer_text(a, b), add_special_tokens=False).ids + [eos]
        items.append((tok.encode(text, add_special_tokens=with_bos).ids, want, text))
    steps = max(len(w) for _, w, _ in items)
    width = max(len(p) for p, _, _ in items) + steps
    correct, failures = 0, []
    with torch.no_grad():
        for start in range(0, len(items), batch_size):
            chunk = items[start : start + batch_size]
            ids = torch.full((len(chunk), width), eos, dtype=torch.long)
            for r, (p, want, _) in enumerate(chunk):
                ids[r, : len(p) + len(want)] = torch.tensor(p + want)
            picks = logits_fn(ids.to(device)).argmax(-1).cpu()
            failed = [(p, text) for r, (p, want, text) in enumerate(chunk)
                      if picks[r, len(p) - 1 : len(p) - 1 + len(want)].tolist() != want]
            correct += len(chunk) - len(failed)
            got = _greedy_tokens(logits_fn, [p for p, _ in failed], steps, width, eos, device)
            failures += [(text, tok.decode(g, skip_special_tokens=False)) for (_, text), g in zip(failed, got)]
    return correct / len(rows), failures


def _greedy_tokens(logits_fn, prompts: list[list[int]], steps: int, width: int, eos: int, device) -> list[list[int]]:
    """``steps`` greedy tokens after each prompt, all rows at once, right-padded to ``width``."""
    import torch

    if not prompts:
        return []
    ids = torch.full((len(prompts), width), eos, dtype=torch.long)
    for r, p in enumerate(prompts):
        ids[r, : len(p)] = torch.tensor(p)
    ids = ids.to(device)
    pos = torch.tensor([len(p) for p in prompts], device=device)
    rows_idx = torch.arange(len(prompts), device=device)
    for _ in range(steps):
        ids[rows_idx, pos] = logits_fn(ids)[rows_idx, pos - 1].argmax(-1)
        pos = pos + 1
    return [ids[r, len(p) : len(p) + steps].tolist() for r, p in enumerate(prompts)]
