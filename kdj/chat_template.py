"""Chat prompts: a model's own Jinja chat template, rendered the way HF transformers renders it
(with jinja2), or a built-in format when the model ships none or jinja2 is not installed:
ChatML (with SmolLM2's default system turn for SmolLM2) or Kimi's
<|im_system|>/<|im_user|>/<|im_assistant|> ... <|im_middle|> ... <|im_end|> turns.

kdj.tokenizer picks the format for each tokenizer; Tokenizer.apply_chat_template renders it.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Callable, Sequence
from datetime import datetime
from typing import Any

SMOLLM_SYSTEM = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"

Messages = Sequence[dict[str, Any]]
# A built-in format: (messages, add_generation_prompt) -> prompt text.
BuiltinChat = Callable[[Messages, bool], str]


def chatml(messages: Messages, add_generation_prompt: bool, default_system: str | None) -> str:
    """<|im_start|>{role}\\n{content}<|im_end|>\\n per message; SmolLM2's template also inserts a
    default system turn when the first message is not a system one."""
    out = []
    if default_system is not None and messages and messages[0]["role"] != "system":
        out.append(f"<|im_start|>system\n{default_system}<|im_end|>\n")
    out += [f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in messages]
    if add_generation_prompt:
        out.append("<|im_start|>assistant\n")
    return "".join(out)


def kimi_chat(messages: Messages, add_generation_prompt: bool) -> str:
    """Kimi turns: <|im_user|>user<|im_middle|>...<|im_end|>; system/tool use <|im_system|>.

    No default system turn is added (Kimi-K2-Instruct's own template adds one): pass a system
    message, or load a checkpoint directory that ships its chat template.
    """
    tags = {"user": "<|im_user|>", "assistant": "<|im_assistant|>"}
    out = [
        f"{tags.get(m['role'], '<|im_system|>')}{m.get('name') or m['role']}<|im_middle|>"
        f"{m['content']}<|im_end|>"
        for m in messages
    ]
    if add_generation_prompt:
        out.append("<|im_assistant|>assistant<|im_middle|>")
    return "".join(out)


def chatml_fallback(token_id, template: str | None) -> BuiltinChat | None:
    """Built-in ChatML when it provably matches: the vocabulary (token_id: spelling -> id or
    None) has <|im_start|>/<|im_end|> and the model's template is absent or is SmolLM2's
    (checked against it in tests)."""
    if token_id("<|im_start|>") is None or token_id("<|im_end|>") is None:
        return None
    if template is None:
        return functools.partial(chatml, default_system=None)
    if SMOLLM_SYSTEM in template:
        return functools.partial(chatml, default_system=SMOLLM_SYSTEM)
    return None


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    # As HF transformers' chat-template filter: no ASCII escaping, optional layout arguments.
    return json.dumps(
        x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _raise_exception(message):
    raise ValueError(f"chat template error: {message}")


@functools.lru_cache(maxsize=8)
def compile_template(source: str):
    """Compile a Jinja chat template with the settings HF transformers uses (trim_blocks,
    lstrip_blocks, loop controls, sandboxed), or return None when jinja2 is not installed."""
    try:
        from jinja2.sandbox import ImmutableSandboxedEnvironment
    except ImportError:
        return None
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(source)


def render_chat(
    messages: Messages,
    add_generation_prompt: bool,
    *,
    template: str | None,
    builtin: BuiltinChat | None,
    bos_token: str,
    eos_token: str,
    name: str,
) -> str:
    """Prompt text for `messages` ([{"role": ..., "content": str}, ...]): the Jinja `template`
    when there is one and jinja2 is installed, else the `builtin` format; ValueError when
    there is neither (`name` names the tokenizer in the message)."""
    for m in messages:
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise ValueError(f"chat message needs a str 'role': {m!r}")
        if not isinstance(m.get("content"), str):
            raise ValueError(f"chat message needs str 'content': {m!r}")
    compiled = compile_template(template) if template else None
    if compiled is not None:
        return compiled.render(
            messages=list(messages),
            add_generation_prompt=add_generation_prompt,
            bos_token=bos_token,
            eos_token=eos_token,
            tools=None,
        )
    if builtin is not None:
        return builtin(messages, add_generation_prompt)
    why = "install jinja2 to render its template" if template else "none shipped"
    raise ValueError(f"tokenizer {name} has no usable chat template ({why})")
