"""The Python API: `LLM(model).generate(prompts, SamplingParams(...))`, a streaming form, `chat(messages)`
(vLLM's LLM.chat: conversations rendered with the model's chat template) and `embed(prompts)` (vLLM's LLM.embed)."""

from __future__ import annotations

from collections.abc import Iterator, Sequence as Seq

from nanochat.engine.llm_engine import LLMEngine
from nanochat.engine.output import EmbeddingResult, Reply, RequestResult, TokenEvent
from nanochat.engine.pooling import PoolingParams
from nanochat.engine.sampling_params import SamplingParams

Prompt = str | list[int]
Conversation = list[dict]


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

    def chat_prompt(self, messages: Conversation, tools: list[dict] | None = None,
                    chat_template_kwargs: dict | None = None) -> list[int]:
        """A conversation's prompt ids: its messages ({"role", "content"}, an assistant's `tool_calls`, tool
        results) rendered whole by the model's chat template (or --chat-template's) with the generation prompt,
        as transformers' apply_chat_template(..., add_generation_prompt=True) renders them. `tools`: function tools
        for templates that render them; `chat_template_kwargs`: the template's other variables (enable_thinking,
        reasoning_effort)."""
        variables = dict(chat_template_kwargs or {})
        if tools:
            variables["tools"] = tools
        text = self.engine.loaded.chat_template.render(list(messages), add_generation_prompt=True, **variables)
        return self.tokenizer.encode(text, add_special_tokens=False)   # the template writes any BOS it wants

    def chat(self, messages: Conversation | Seq[Conversation],
             sampling_params: SamplingParams | list[SamplingParams] | None = None, tools: list[dict] | None = None,
             chat_template_kwargs: dict | None = None, use_tqdm: bool = False) -> list[RequestResult]:
        """The next assistant message of one conversation (a list of messages) or of each of several, batched as
        generate() batches prompts. The text is the model's whole reply (a reasoning model's thinking included)."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        prompts = [self.chat_prompt(c, tools, chat_template_kwargs) for c in conversations]
        return self.generate(prompts, sampling_params, use_tqdm)

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

    def embed(self, prompts: Prompt | Seq[Prompt], pooling_params: PoolingParams | None = None,
              truncate: bool = False) -> list[EmbeddingResult]:
        """One embedding per prompt (text, encoded as generate() encodes it, or ids), batched as generate() batches:
        the final hidden states pooled as the model's files say (mean when they do not) and normalized, unless
        `pooling_params` says otherwise (engine/pooling.py)."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        ids = []
        try:
            for p in prompts:
                ids.append(self.engine.add_embedding(p, pooling_params, truncate=truncate))
            replies = {rid: Reply() for rid in ids}
            while not all(r.done for r in replies.values()):
                for ev in self.engine.step():
                    replies[ev.request_id].add(ev)
        finally:
            for rid in ids:
                self.engine.abort(rid)   # those still running, when a step failed or a prompt was refused
        results = []
        for rid in ids:
            reply = replies[rid]
            if reply.embedding is None:
                raise RuntimeError(reply.final.error or f"embedding request {rid} ended: {reply.final.finish_reason}")
            results.append(EmbeddingResult(rid, reply.embedding, reply.stats))
        return results
