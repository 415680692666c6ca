"""The offline Python API: `LLM(...).generate(prompts, SamplingParams(...))`, and
`LLM(...).embed(prompts)` for embeddings."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from swaserve.config import EngineConfig
from swaserve.engine.engine import Engine
from swaserve.engine.request import Request
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

    def embed(self, prompts: Prompt | Sequence[Prompt]) -> list[list[float]]:
        """One embedding per prompt (a string or token ids), pooled as the model's
        sentence-transformers modules or `pooling` say (engine/embedder.py)."""
        plist = _as_prompt_list(prompts)
        if not plist:
            raise ValueError("prompts: at least one prompt is needed")
        return self.engine.embed(plist)
