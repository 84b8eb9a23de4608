"""Offline API, vLLM-like: ``LLM(model=DIR, **engine_args).generate(prompts, params)``."""

from __future__ import annotations

import itertools
import time
from collections.abc import Sequence as SequenceABC

from tqdm import tqdm

from server.config import EngineConfig
from server.engine_core import EngineCore
from server.outputs import OutputAccumulator, RequestOutput
from server.sampling_params import SamplingParams


def bundled_model_dir() -> str:
    import os

    import configs

    return os.path.join(os.path.dirname(os.path.abspath(configs.__file__)), "arith")


class LLM:
    def __init__(self, model: str | None = None, **engine_args) -> None:
        config = EngineConfig.from_kwargs(model=model, **engine_args)
        if config.data_parallel_size > 1:
            raise ValueError("data_parallel_size > 1 needs one engine process per DP rank: serve it "
                             "with `mlaserve serve ... -dp N`; the offline LLM runs one engine")
        if config.world_size > 1 and config.nnodes == 1:
            import dataclasses

            from distributed.launcher import find_free_port

            config = dataclasses.replace(config, master_port=find_free_port(config.master_addr))
        self.config = config
        self.engine = EngineCore(config, model or bundled_model_dir())
        self.tokenizer = self.engine.tokenizer
        self._ids = itertools.count()

    def generate(
        self,
        prompts: str | list[str] | list[int] | list[list[int]] | None = None,
        sampling_params: SamplingParams | list[SamplingParams] | None = None,
        prompt_token_ids: list[list[int]] | None = None,
        use_tqdm: bool = False,
    ) -> list[RequestOutput]:
        """Run every prompt to completion in one continuous batch; outputs in prompt order."""
        texts, token_lists = self._normalize(prompts, prompt_token_ids)
        params = sampling_params or SamplingParams()
        params_list = params if isinstance(params, list) else [params] * len(token_lists)
        if len(params_list) != len(token_lists):
            raise ValueError("sampling_params list must match the number of prompts")
        accs: dict[str, OutputAccumulator] = {}
        order = []
        for text, ids, p in zip(texts, token_lists, params_list):
            rid = str(next(self._ids))
            self.engine.add_request(rid, ids, p)
            accs[rid] = OutputAccumulator(rid, text, ids, p.n, p.logprobs is not None, time.monotonic())
            order.append(rid)
        bar = tqdm(total=len(order), desc="Processed prompts", disable=not use_tqdm)
        while self.engine.has_unfinished():
            deltas = self.engine.step()
            now = time.monotonic()  # one arrival time for the step's tokens
            for delta in deltas:
                acc = accs.get(delta.request_id)
                if acc is None:
                    continue
                acc.apply(delta, now)
                if delta.finished:
                    bar.update(1)
        bar.close()
        return [accs[r].output for r in order]

    def _normalize(self, prompts, prompt_token_ids) -> tuple[list[str | None], list[list[int]]]:
        if prompt_token_ids is not None:
            return [None] * len(prompt_token_ids), [list(p) for p in prompt_token_ids]
        if prompts is None:
            raise ValueError("give prompts or prompt_token_ids")
        if isinstance(prompts, str):
            prompts = [prompts]
        if prompts and isinstance(prompts[0], int):
            return [None], [list(prompts)]
        texts, ids = [], []
        for p in prompts:
            if isinstance(p, str):
                texts.append(p)
                ids.append(self.tokenizer.encode(p))
            elif isinstance(p, SequenceABC):
                texts.append(None)
                ids.append(list(p))
            else:
                raise TypeError(f"unsupported prompt type {type(p).__name__}")
        return texts, ids

    def shutdown(self) -> None:
        """Stop TP workers and leave the process groups (no-op for a single-process engine)."""
        self.engine.shutdown()

