"""The Python API: `LLM(model).generate(prompts, SamplingParams(...))` and a streaming form."""

from __future__ import annotations

from collections.abc import Iterator, Sequence as Seq

from nanochat.engine.llm_engine import LLMEngine
from nanochat.engine.output import Reply, RequestResult, TokenEvent
from nanochat.engine.sampling_params import SamplingParams

Prompt = str | list[int]


class LLM:
    def __init__(self, model: str, load_progress=None, **config):
        self.engine = LLMEngine(model, load_progress=load_progress, **config)
        self.tokenizer = self.engine.tokenizer

    def describe(self):
        """What the model runs on: a models.report.ModelReport (weight types, kernels, fast path, KV cache)."""
        return self.engine.describe()

    def _submit(self, prompts, sampling_params) -> list[str]:
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            sampling_params = [sampling_params or SamplingParams()] * len(prompts)
        if len(sampling_params) != len(prompts):
            raise ValueError(f"got {len(sampling_params)} sampling params for {len(prompts)} prompts")
        return [self.engine.add_request(p, sp) for p, sp in zip(prompts, sampling_params)]

    def stream(self, prompts: Prompt | Seq[Prompt],
               sampling_params: SamplingParams | list[SamplingParams] | None = None) -> Iterator[TokenEvent]:
        """Yield TokenEvents (request ids "req-N" in prompt order) as tokens are generated."""
        pending = set(self._submit(prompts, sampling_params))
        try:
            while pending:
                for event in self.engine.step():
                    if event.finished:
                        pending.discard(event.request_id)
                    yield event
        finally:   # a consumer that stops early must not leave requests holding blocks
            for rid in pending:
                self.engine.abort(rid)

    def generate(self, prompts: Prompt | Seq[Prompt],
                 sampling_params: SamplingParams | list[SamplingParams] | None = None,
                 use_tqdm: bool = False) -> list[RequestResult]:
        ids = self._submit(prompts, sampling_params)
        replies = {rid: Reply() for rid in ids}
        bar = None
        if use_tqdm:
            from tqdm.auto import tqdm
            bar = tqdm(total=len(ids), desc="Generating", dynamic_ncols=True)
        try:
            while not all(r.done for r in replies.values()):
                for ev in self.engine.step():
                    if replies[ev.request_id].add(ev).done and bar:
                        bar.update(1)
        finally:
            for rid, reply in replies.items():
                if not reply.done:
                    self.engine.abort(rid)
            if bar:
                bar.close()
        return [replies[rid].result(rid) for rid in ids]
