"""A model's chat template, as transformers' ``apply_chat_template`` renders it (what vLLM's
``/v1/chat/completions`` renders a conversation with): the template of the model folder's
chat_template.jinja, else its tokenizer_config.json's ``chat_template`` (a string, or a list of
named ones, "default" taken), in jinja2's immutable sandbox with transformers' settings
(trim_blocks, lstrip_blocks, loop controls; ``raise_exception``, ``strftime_now`` and its
``tojson``), given the messages, ``add_generation_prompt``, the tokenizer's special tokens as
strings (``bos_token``, ``eos_token``, ...) and the request's ``chat_template_kwargs``.

A template is the operator's (from the model folder), not a client's: a request cannot give one.
The sandbox still bounds what it may touch, as transformers runs Hub templates in it.
"""

from __future__ import annotations

import datetime
import json
from pathlib import Path
from typing import Optional

from .llm_model_files import read_json

# tokenizer_config.json's special tokens a template may read (the tokenizer's special_tokens_map)
SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")


class ChatTemplateError(ValueError):
    """A conversation the template refused (its ``raise_exception``) or could not render."""


def _raise_exception(message):
    import jinja2

    raise jinja2.exceptions.TemplateError(message)


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    # transformers' own: jinja2's escapes HTML characters, which a prompt must keep
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(format):
    return datetime.datetime.now().strftime(format)


class ChatTemplate:
    """A folder's compiled template and special tokens (``load``: None where it has none)."""

    def __init__(self, source: str, special: dict):
        import jinja2
        import jinja2.ext
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                           extensions=[jinja2.ext.loopcontrols])
        env.filters["tojson"] = _tojson
        env.globals["raise_exception"] = _raise_exception
        env.globals["strftime_now"] = _strftime_now
        try:
            self.template = env.from_string(source)
        except jinja2.exceptions.TemplateError as e:
            raise ChatTemplateError(f"the model's chat template does not compile: {e}") from None
        self.special = special

    @classmethod
    def load(cls, folder: str | Path) -> Optional["ChatTemplate"]:
        folder = Path(folder)
        config = read_json(folder / "tokenizer_config.json")
        try:
            source = (folder / "chat_template.jinja").read_text()
        except OSError:
            source = config.get("chat_template")
        if isinstance(source, list):  # named templates: the default one
            source = next((t.get("template") for t in source if isinstance(t, dict) and t.get("name") == "default"),
                          None)
        if not isinstance(source, str) or not source:
            return None
        special = {}
        for name in SPECIAL_TOKENS:
            token = config.get(name)
            token = token.get("content") if isinstance(token, dict) else token
            if isinstance(token, str):
                special[name] = token
        return cls(source, special)

    def render(self, messages: list[dict], add_generation_prompt: bool = True, kwargs: Optional[dict] = None) -> str:
        """The conversation as the model's prompt text; ChatTemplateError where the template
        refuses it. ``kwargs`` (chat_template_kwargs) cannot replace what this passes."""
        import jinja2

        context = {**self.special, **(kwargs or {}), "messages": messages, "tools": None, "documents": None,
                   "add_generation_prompt": add_generation_prompt}
        try:
            return self.template.render(**context)
        except jinja2.exceptions.TemplateError as e:  # (raise_exception's too, and the sandbox's refusals)
            raise ChatTemplateError(f"the model's chat template refused the conversation: {e}") from None
        except (TypeError, ValueError, KeyError, IndexError, AttributeError) as e:
            raise ChatTemplateError(f"the model's chat template failed on the conversation: "
                                    f"{type(e).__name__}: {e}") from None
