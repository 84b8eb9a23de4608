"""Logprobs in the OpenAI response shapes, shared by whole responses and stream chunks.

Completions use the legacy shape (parallel ``tokens`` / ``token_logprobs`` / ``top_logprobs`` /
``text_offset`` lists); chat uses ``content`` entries with their UTF-8 bytes. JSON has no
-inf, so every logprob is clamped at ``MIN_LOGPROB`` (as vLLM does).
"""

from __future__ import annotations

from server.outputs import TokenLogprob
from server.protocol import ChatCompletionLogProbs, ChatLogProb, ChatLogProbsContent, CompletionLogProbs

MIN_LOGPROB = -9999.0


def completion_logprobs(tokenizer, token_ids: list[int], logprobs: list[TokenLogprob | None], top_n: int,
                        offset: int) -> CompletionLogProbs:
    """``offset``: the text offset of the first token (a stream continues where it left off).
    A token without a logprob (the first prompt token under echo) gets None entries."""
    res = CompletionLogProbs()
    for tid, lp in zip(token_ids, logprobs):
        tok = tokenizer.token_to_text(tid)
        res.tokens.append(tok)
        res.text_offset.append(offset)
        offset += len(tok)
        if lp is None:
            res.token_logprobs.append(None)
            res.top_logprobs.append(None)
            continue
        res.token_logprobs.append(max(lp.logprob, MIN_LOGPROB))
        top: dict[str, float] = {}
        for alt_id, alt_lp in sorted(lp.top.items(), key=lambda kv: -kv[1])[:top_n]:
            top.setdefault(tokenizer.token_to_text(alt_id), max(alt_lp, MIN_LOGPROB))
        top.setdefault(tok, max(lp.logprob, MIN_LOGPROB))
        res.top_logprobs.append(top)
    return res


def chat_logprobs(tokenizer, token_ids: list[int], logprobs: list[TokenLogprob] | None,
                  top_n: int) -> ChatCompletionLogProbs:
    def entry(tid: int, value: float) -> ChatLogProb:
        tok = tokenizer.token_to_text(tid)
        return ChatLogProb(token=tok, logprob=max(value, MIN_LOGPROB), bytes=list(tok.encode("utf-8")))

    content = []
    for tid, lp in zip(token_ids, logprobs or []):
        chosen = entry(tid, lp.logprob)
        alts = [entry(a, v) for a, v in sorted(lp.top.items(), key=lambda kv: -kv[1])[:top_n]]
        content.append(ChatLogProbsContent(**chosen.model_dump(), top_logprobs=alts))
    return ChatCompletionLogProbs(content=content)
