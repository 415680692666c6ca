"""The tokenizer over HTTP, in vLLM's shapes: /tokenize, /detokenize and /tokenizer_info
(what lm-eval's remote tokenizer reads: the special tokens and the chat template in use)."""

from __future__ import annotations

import asyncio

from fastapi import FastAPI

from swaserve.chat.setup import starts_with_bos
from swaserve.server.bounds import check_text
from swaserve.server.chat_path import plan_tools
from swaserve.server.chat_prompt import chat_prompt
from swaserve.server.errors import APIError
from swaserve.server.openai.protocol import DetokenizeRequest, TokenizeRequest
from swaserve.server.state import AppState


def add_routes(app: FastAPI, state: AppState) -> None:
    engine, tok, template = state.engine, state.tokenizer, state.template
    max_len = state.max_model_len
    check_model = state.check_model

    def need_tokenizer(param: str) -> None:
        if tok is None:
            raise APIError(400, f"{param}: this model has no tokenizer files", param)

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest):
        check_model(body.model)
        if (body.prompt is None) == (body.messages is None):
            raise APIError(400, "prompt: give exactly one of prompt and messages", "prompt")
        param = "prompt" if body.prompt is not None else "messages"
        need_tokenizer(param)

        plan = plan_tools(body) if body.messages is not None else None

        def work() -> list[int]:
            special = body.add_special_tokens
            if body.prompt is not None:
                text = body.prompt
            else:  # as a chat would be prompted
                text = chat_prompt(state, body, plan)
                if special is None:
                    special = not starts_with_bos(state.tokenizer, text)
            check_text(tok, text, max_len, param)  # more than a prompt can be: untokenized
            return tok.encode(text, add_special_tokens=special is not False)

        ids = await asyncio.to_thread(work)
        return {"tokens": ids, "count": len(ids), "max_model_len": max_len}

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest):
        check_model(body.model)
        need_tokenizer("tokens")
        bad = [t for t in body.tokens if t >= engine.vocab_size]
        if bad:
            raise APIError(400, f"tokens: token id {bad[0]} is outside the vocabulary "
                           f"(0..{engine.vocab_size - 1})", "tokens")
        text = await asyncio.to_thread(tok.decode, body.tokens, False)
        return {"prompt": text}

    @app.get("/tokenizer_info")
    async def tokenizer_info():
        need_tokenizer("tokenizer")

        def name(token_id: int | None) -> str | None:
            return tok.id_to_token(token_id) if token_id is not None else None

        eos = tok.eos_token_ids[0] if tok.eos_token_ids else None
        pad = engine.whole_model_config.pad_token_id
        named = tok.special_tokens
        return {"tokenizer_class": "PreTrainedTokenizerFast",
                "bos_token": named.get("bos_token", name(tok.bos_token_id)),
                "eos_token": named.get("eos_token", name(eos)),
                "pad_token": named.get("pad_token", name(pad)),
                "chat_template": template.sources.get("default", template.sources),
                "special_tokens": named,
                "model_max_length": max_len, "vocab_size": tok.vocab_size}
