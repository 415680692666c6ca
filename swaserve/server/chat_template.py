"""Chat templates: the model's own Jinja template, rendered in a sandbox, or the built-in
Gemma turn template for GGUFs that carry none (the bundled base model)."""

from __future__ import annotations

from typing import Any

from jinja2 import TemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment

GEMMA_TEMPLATE = (
    "{% set ns = namespace(sys='') %}"
    "{% for m in messages %}"
    "{% if m['role'] in ('system', 'developer') %}{% set ns.sys = ns.sys + m['content'] + '\\n\\n' %}"
    "{% else %}"
    "{{ '<start_of_turn>' + ('model' if m['role'] == 'assistant' else 'user') + '\\n' }}"
    "{{ ns.sys }}{% set ns.sys = '' %}"
    "{{ (m['content'] | trim) + '<end_of_turn>\\n' }}"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<start_of_turn>model\\n' }}{% endif %}"
)
GEMMA_END_OF_TURN = "<end_of_turn>"


class ChatTemplateError(ValueError):
    pass


def _raise(message: str):
    raise ChatTemplateError(message)


class ChatTemplate:
    def __init__(self, source: str | None, bos_token: str = "", eos_token: str = ""):
        self.builtin = source is None
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.globals["raise_exception"] = _raise
        try:
            self._t = env.from_string(source or GEMMA_TEMPLATE)
        except TemplateError as e:
            raise ChatTemplateError(f"chat template does not compile: {e}") from e
        self.bos_token, self.eos_token = bos_token, eos_token

    def render(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
               tools: list[dict] | None = None) -> str:
        flat = []
        for m in messages:
            content = m.get("content")
            if isinstance(content, list):  # OpenAI content parts: keep the text ones
                if any(not isinstance(p, dict) or p.get("type") != "text"
                       or not isinstance(p.get("text"), str) for p in content):
                    raise ChatTemplateError("messages: only text content parts are supported")
                content = "".join(p["text"] for p in content)
            elif content is not None and not isinstance(content, str):
                raise ChatTemplateError("messages: content must be a string or text parts")
            flat.append({**m, "content": content or ""})
        try:
            return self._t.render(messages=flat, add_generation_prompt=add_generation_prompt,
                                  bos_token=self.bos_token, eos_token=self.eos_token,
                                  tools=tools)
        except ChatTemplateError:
            raise
        except Exception as e:  # noqa: BLE001 - any template failure is the request's problem
            raise ChatTemplateError(f"messages: the chat template failed: {e}") from e
