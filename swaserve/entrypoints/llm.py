"""The offline Python API: `LLM(...).generate(prompts, SamplingParams(...))`,
`LLM(...).chat(messages)` for conversations (entrypoints/chat.py), and
`LLM(...).embed(prompts)` for embeddings."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from swaserve.chat.events import Event
from swaserve.chat.setup import ChatSetup, chat_setup
from swaserve.config import EngineConfig
from swaserve.engine.engine import Engine
from swaserve.engine.request import Request
from swaserve.entrypoints.chat import (
    ChatMessage,
    Conversation,
    MessageReader,
    conversations,
    read_message,
    render_chat,
    tool_plan,
)
from swaserve.sampling.params import SamplingParams

Prompt = str | list[int]


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None  # "stop" | "length" | "abort" | "error"
    logprobs: list[dict[int, float]] | None
    stop_reason: str | int | None = None
    error: str | None = None  # why it failed (finish_reason "error"); the others are unaffected


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    num_cached_tokens: int = 0
    # SamplingParams.prompt_logprobs: per prompt token {token: logprob, top ones...}; the
    # first token's is None
    prompt_logprobs: list[dict[int, float] | None] | None = None

    @property
    def text(self) -> str:
        return self.outputs[0].text

    @property
    def token_ids(self) -> list[int]:
        return self.outputs[0].token_ids

    @property
    def finish_reason(self) -> str | None:
        return self.outputs[0].finish_reason


@dataclass
class ChatOutput(RequestOutput):
    """A conversation's RequestOutput (its prompt is the rendered chat) and each
    completion read as a message; `message` is the first one's."""

    messages: list[ChatMessage] = field(default_factory=list)

    @property
    def message(self) -> ChatMessage:
        return self.messages[0]


def completion_output(index: int, req: Request) -> CompletionOutput:
    return CompletionOutput(index, req.output_text, list(req.output_token_ids),
                            req.finish_reason.value if req.finish_reason else None,
                            req.logprobs, req.stop_reason,
                            req.error.message if req.error is not None else None)


def _as_prompt_list(prompts: Prompt | Sequence[Prompt]) -> list[Prompt]:
    if isinstance(prompts, str):
        return [prompts]
    prompts = list(prompts)
    if prompts and all(isinstance(t, int) and not isinstance(t, bool) for t in prompts):
        return [prompts]  # one prompt given as token ids
    return prompts


class LLM:
    """Offline engine. `LLM()` loads the bundled Gemma 3 270M; `LLM(model=...)` a .gguf file,
    an HF directory, a Hugging Face repo id (`"Qwen/Qwen3-0.6B"`, with `revision=`) or a GGUF
    repo and quantization (`"org/name-GGUF:Q4_K_M"`). Keyword arguments are EngineConfig
    fields (dtype, max_running_requests, max_model_len, chunk_size, page_size, kv_memory,
    ...)."""

    def __init__(self, model: str | None = None, **kwargs):
        self.engine = Engine(EngineConfig(model=model, **kwargs))
        self._chat: ChatSetup | None = None

    def chat_setup(self, chat_template: str | None = None) -> ChatSetup:
        """The model's chat template and formats (chat/setup.py); `chat_template`, a
        template's text, replaces the model's own. A ValueError where chat is impossible."""
        if self.tokenizer is None:
            raise ValueError("messages: this model has no tokenizer, so it has no chat "
                             "template and chat is unavailable")
        if chat_template is not None:
            return chat_setup(self.tokenizer, chat_template)
        if self._chat is None:
            self._chat = chat_setup(self.tokenizer)
        return self._chat

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def generate(self, prompts: Prompt | Sequence[Prompt],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None
                 ) -> list[RequestOutput]:
        plist = _as_prompt_list(prompts)
        if not plist:
            raise ValueError("prompts: at least one prompt is needed")
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            params = [sampling_params or SamplingParams()] * len(plist)
        else:
            params = list(sampling_params)
            if len(params) != len(plist):
                raise ValueError(f"sampling_params: {len(params)} given for {len(plist)} prompts")
        eng = self.engine
        groups: list[list[Request]] = []
        try:  # all or nothing: a bad prompt or parameter queues none of them
            for prompt, p in zip(plist, params):
                groups.append(eng.add_request(prompt, p))
        except Exception:
            for g in groups:
                for r in g:
                    eng.abort(r.request_id)
                    eng.release(r.request_id)
            raise
        pending = [r for g in groups for r in g]
        while any(not r.is_finished for r in pending):
            eng.step()
            if eng.last_step is None:  # nothing could be scheduled: never spin
                raise RuntimeError("engine stalled: no request could be scheduled")
        eng.settle()  # a step in flight may still hold finished requests' memory
        results = []
        for prompt, g in zip(plist, groups):
            results.append(RequestOutput(
                g[0].group_id,
                prompt if isinstance(prompt, str) else None, list(g[0].prompt_token_ids),
                [completion_output(i, r) for i, r in enumerate(g)], g[0].num_cached_tokens,
                g[0].prompt_logprobs))
            for r in g:
                eng.release(r.request_id)
        return results

    def chat(self, messages: Conversation | Sequence[Conversation],
             sampling_params: SamplingParams | None = None, *,
             tools: Sequence[dict] | None = None,
             chat_template_kwargs: dict[str, Any] | None = None,
             chat_template: str | None = None, add_generation_prompt: bool = True,
             continue_final_message: bool = False) -> list[ChatOutput]:
        """Answer one conversation (a list of `{"role", "content", ...}` dicts, OpenAI's
        shape) or a list of them: each is rendered with the model's chat template and
        tokenized as the server's /v1/chat/completions does, generated, and each
        completion read by the model's chat format into content, reasoning and tool calls.
        `tools` (OpenAI's function specs) are offered to the model, which calls them as it
        likes. A malformed message or a model without chat is a ValueError."""
        convs = conversations(messages)
        setup = self.chat_setup(chat_template)
        plan = tool_plan(tools)
        prompts = [render_chat(setup, self.tokenizer, c, sampling_params or SamplingParams(),
                               plan, chat_template_kwargs=chat_template_kwargs,
                               add_generation_prompt=add_generation_prompt,
                               continue_final_message=continue_final_message)
                   for c in convs]
        outs = self.generate([p.token_ids for p in prompts], [p.params for p in prompts])
        return [ChatOutput(o.request_id, p.text, o.prompt_token_ids, o.outputs,
                           o.num_cached_tokens, o.prompt_logprobs,
                           [read_message(p.parser, c.token_ids, c.text) for c in o.outputs])
                for p, o in zip(prompts, outs)]

    def chat_stream(self, messages: Conversation, sampling_params: SamplingParams | None = None,
                    *, chat_template_kwargs: dict[str, Any] | None = None
                    ) -> Iterator[Event]:
        """Answer one conversation as its tokens arrive: the events (reasoning, content)
        of its first completion, read by the model's chat format. Leaving the loop early
        aborts the request."""
        [conv] = conversations([messages])
        p = render_chat(self.chat_setup(), self.tokenizer, conv,
                        sampling_params or SamplingParams(), None,
                        chat_template_kwargs=chat_template_kwargs)
        eng = self.engine
        reqs = eng.add_request(p.token_ids, p.params)
        req, reader = reqs[0], MessageReader(p.parser() if p.parser is not None else None)
        ids = chars = 0
        try:
            while True:
                done = req.is_finished
                new_ids, new_text = req.output_token_ids[ids:], req.output_text[chars:]
                ids, chars = ids + len(new_ids), chars + len(new_text)
                yield from reader.feed(new_ids, new_text)
                if done:
                    break
                eng.step()
                if eng.last_step is None and not req.is_finished:
                    raise RuntimeError("engine stalled: no request could be scheduled")
            yield from reader.finish()
        finally:
            for r in reqs:
                eng.abort(r.request_id)
            eng.settle()
            for r in reqs:
                eng.release(r.request_id)

    def embed(self, prompts: Prompt | Sequence[Prompt]) -> list[list[float]]:
        """One embedding per prompt (a string or token ids), pooled as the model's
        sentence-transformers modules or `pooling` say (engine/embedder.py)."""
        plist = _as_prompt_list(prompts)
        if not plist:
            raise ValueError("prompts: at least one prompt is needed")
        return self.engine.embed(plist)
