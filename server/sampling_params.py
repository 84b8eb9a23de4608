"""Per-request sampling parameters (vLLM's names and defaults), validated on construction."""

from __future__ import annotations

from dataclasses import dataclass, field

from server.errors import InvalidRequestError

MAX_LOGPROBS = 20


@dataclass
class SamplingParams:
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: disabled
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    max_tokens: int | None = 16  # None: up to max_model_len
    min_tokens: int = 0
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    logprobs: int | None = None  # number of top alternatives per generated token
    prompt_logprobs: int | None = None  # same, for prompt positions
    skip_special_tokens: bool = True
    logit_bias: dict[int, float] | None = None  # token id -> bias added to its logit (OpenAI)

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.top_k == -1:
            self.top_k = 0
        self.validate()

    def validate(self, max_logprobs: int | None = None) -> None:
        """``max_logprobs``: the engine's --max-logprobs (None: only non-negative is checked)."""

        def bad(msg: str) -> None:
            raise InvalidRequestError(msg)

        if not isinstance(self.n, int) or self.n < 1:
            bad(f"n must be at least 1, got {self.n}.")
        if self.temperature < 0.0:
            bad(f"temperature must be non-negative, got {self.temperature}.")
        if not 0.0 < self.top_p <= 1.0:
            bad(f"top_p must be in (0, 1], got {self.top_p}.")
        if self.top_k < 0:
            bad(f"top_k must be -1 (disable), 0 (disable) or at least 1, got {self.top_k}.")
        if not 0.0 <= self.min_p <= 1.0:
            bad(f"min_p must be in [0, 1], got {self.min_p}.")
        if not -2.0 <= self.presence_penalty <= 2.0:
            bad(f"presence_penalty must be in [-2, 2], got {self.presence_penalty}.")
        if not -2.0 <= self.frequency_penalty <= 2.0:
            bad(f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}.")
        if self.repetition_penalty <= 0.0:
            bad(f"repetition_penalty must be greater than zero, got {self.repetition_penalty}.")
        if self.max_tokens is not None and self.max_tokens < 1:
            bad(f"max_tokens must be at least 1, got {self.max_tokens}.")
        if self.min_tokens < 0:
            bad(f"min_tokens must be greater than or equal to 0, got {self.min_tokens}.")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            bad(f"min_tokens must be less than or equal to max_tokens={self.max_tokens}, got {self.min_tokens}.")
        for name in ("logprobs", "prompt_logprobs"):
            v = getattr(self, name)
            if v is not None and (v < 0 or (max_logprobs is not None and v > max_logprobs)):
                bad(f"{name} must be between 0 and {max_logprobs if max_logprobs is not None else 'inf'}, "
                    f"got {v}.")
        if any(not s for s in self.stop):
            bad("stop strings must not be empty.")
        if self.seed is not None and not isinstance(self.seed, int):
            bad("seed must be an integer.")
        if self.logit_bias:
            self.logit_bias = {int(k): float(v) for k, v in self.logit_bias.items()}
            for tok, bias in self.logit_bias.items():
                if tok < 0:
                    bad(f"logit_bias token id {tok} must be non-negative.")
                if not -100.0 <= bias <= 100.0:
                    bad(f"logit_bias values must be in [-100, 100], got {bias} for token {tok}.")

    @property
    def greedy(self) -> bool:
        return self.temperature < 1e-5
