"""Benchmark prompts: vLLM's ``random`` dataset, as token-id prompts.

vLLM's RandomDataset draws each request's input and output length uniformly from
``[floor(len·(1−r)), ceil(len·(1+r))]`` (r = ``range_ratio``, 0 by default: exact lengths),
puts a shared random prefix of ``prefix_len`` tokens in front, and fills the rest with the
run ``allowed[(offset + index + arange(input_len)) % len(allowed)]`` where ``allowed`` is the
vocabulary minus the special tokens and ``offset`` is random per request. It then decodes to
text and re-encodes, which can change the length by a token or two. We send the token ids
themselves (``/v1/completions`` and ``LLM.generate`` both take them), so every prompt has
exactly the length asked for and no tokenizer is needed on the client.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np

DATASETS = ("random",)


class DatasetError(ValueError):
    """The dataset settings cannot produce valid requests; the message names the flag."""


@dataclass(frozen=True)
class SampleRequest:
    """One benchmark request: the prompt's token ids and how many tokens to generate."""

    prompt_token_ids: list[int]
    expected_output_len: int

    @property
    def prompt_len(self) -> int:
        return len(self.prompt_token_ids)


def _length_bounds(length: int, range_ratio: float, minimum: int) -> tuple[int, int]:
    low = max(minimum, math.floor(length * (1.0 - range_ratio)))
    high = max(minimum, math.ceil(length * (1.0 + range_ratio)))
    return low, high


def sample_random_requests(
    num_requests: int,
    input_len: int,
    output_len: int,
    vocab_size: int,
    *,
    special_token_ids: Iterable[int] = (),
    range_ratio: float = 0.0,
    prefix_len: int = 0,
    seed: int = 0,
) -> list[SampleRequest]:
    """``num_requests`` random token-id prompts with vLLM's random-dataset semantics.

    Reproducible from ``seed`` (its own numpy Generator; global RNG state is untouched).
    """
    if num_requests < 1:
        raise DatasetError(f"--num-prompts: must be at least 1, got {num_requests}")
    if input_len < 0:
        raise DatasetError(f"--input-len: must not be negative, got {input_len}")
    if output_len < 1:
        raise DatasetError(f"--output-len: must be at least 1, got {output_len}")
    if prefix_len < 0:
        raise DatasetError(f"--random-prefix-len: must not be negative, got {prefix_len}")
    if not 0.0 <= range_ratio < 1.0:
        raise DatasetError(f"--random-range-ratio: must be in [0, 1), got {range_ratio}")
    in_low, in_high = _length_bounds(input_len, range_ratio, 0)
    if prefix_len + in_low < 1:
        raise DatasetError(
            f"--input-len {input_len} with --random-range-ratio {range_ratio} and --random-prefix-len "
            f"{prefix_len} can give an empty prompt; every prompt needs at least one token")
    out_low, out_high = _length_bounds(output_len, range_ratio, 1)
    special = set(special_token_ids)
    allowed = np.array([t for t in range(vocab_size) if t not in special], dtype=np.int64)
    if allowed.size == 0:
        raise DatasetError(f"the vocabulary ({vocab_size} ids) has no non-special token to build prompts from")

    rng = np.random.default_rng(seed)
    input_lens = rng.integers(in_low, in_high + 1, size=num_requests)
    output_lens = rng.integers(out_low, out_high + 1, size=num_requests)
    offsets = rng.integers(0, vocab_size, size=num_requests)
    prefix = allowed[rng.integers(0, allowed.size, size=prefix_len)].tolist() if prefix_len else []
    requests = []
    for i in range(num_requests):
        body = allowed[(int(offsets[i]) + i + np.arange(int(input_lens[i]))) % allowed.size].tolist()
        requests.append(SampleRequest(prefix + body, int(output_lens[i])))
    return requests
