"""A model's chat template, as transformers' ``apply_chat_template`` renders it (what vLLM's
``/v1/chat/completions`` renders a conversation with): the template of the model folder's
chat_template.jinja, else its tokenizer_config.json's ``chat_template`` (a string, or a list of
named ones, "default" taken), in jinja2's immutable sandbox with transformers' settings
(trim_blocks, lstrip_blocks, loop controls, its ``{% generation %}`` tag; ``raise_exception``,
``strftime_now``, its ``tojson``, and its ``dict`` and ``namespace``, which refuse underscore
names), given the messages, ``add_generation_prompt``, the tokenizer's special tokens as strings
(``bos_token``, ``eos_token``, ...: tokenizer_config.json's, special_tokens_map.json's over
them) and the request's ``chat_template_kwargs``. As vLLM renders one, a ``developer`` message
is a ``system`` one where the template never names that role (the system messages then merged
into one, first).

A template is the operator's (from the model folder), not a client's: a request cannot give one.
The sandbox still bounds what it may touch, as transformers runs Hub templates in it.
"""

from __future__ import annotations

import datetime
import json
from pathlib import Path
from typing import Optional

from .llm_model_files import read_json

MAX_TEMPLATE_BYTES = 1 << 20  # a chat template file: tens of KB in models that ship one

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


def _environment():
    """transformers' sandbox for chat templates (chat_template_utils._cached_compile_jinja_template)."""
    import jinja2
    import jinja2.ext
    import jinja2.nodes
    import jinja2.utils
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class Generation(jinja2.ext.Extension):
        # transformers marks the assistant's text with it (for training masks); rendering, it is its body
        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(["name:endgeneration"], drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

        def _body(self, caller):
            return caller()

    class TemplateDict:  # dict() and dict.fromkeys() only: no attribute access to the type
        def __call__(self, *args, **kwargs):
            return dict(*args, **kwargs)

        def fromkeys(self, *args, **kwargs):
            return dict.fromkeys(*args, **kwargs)

    class TemplateNamespace(jinja2.utils.Namespace):  # no underscore names (CPython's internals)
        def __init__(*args, **kwargs):
            self, args = args[0], args[1:]
            attrs = dict(*args, **kwargs)
            for name in attrs:
                TemplateNamespace._check_name(name)
            jinja2.utils.Namespace.__init__(self, attrs)

        def __setitem__(self, name, value):
            TemplateNamespace._check_name(name)
            jinja2.utils.Namespace.__setitem__(self, name, value)

        @staticmethod
        def _check_name(name):
            if isinstance(name, str) and name.startswith("_"):
                raise jinja2.exceptions.SecurityError(f"chat templates cannot store underscore-prefixed attributes "
                                                      f"on a namespace, got {name!r}")

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[Generation, jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["dict"] = TemplateDict()
    env.globals["namespace"] = TemplateNamespace
    return env


class ChatTemplate:
    """A folder's compiled template and special tokens (``load``: None where it has none)."""

    def __init__(self, source: str, special: dict):
        try:
            self.template = _environment().from_string(source)
        except Exception as e:  # noqa: BLE001 -- a syntax error, or one jinja2 meets compiling
            raise ChatTemplateError(f"the model's chat template does not compile: {e}") from None
        self.special = special
        # (vLLM's test of whether a template knows the role)
        self.knows_developer = '"developer"' in source or "'developer'" in source
        self.reads_content = "content" in source  # (transformers' test before it continues a message)

    @classmethod
    def load(cls, folder: str | Path) -> Optional["ChatTemplate"]:
        folder = Path(folder)
        config = read_json(folder / "tokenizer_config.json")
        path = folder / "chat_template.jinja"
        try:
            if path.stat().st_size > MAX_TEMPLATE_BYTES:
                raise ChatTemplateError(f"{path}: more than {MAX_TEMPLATE_BYTES} bytes")
            source = path.read_bytes().decode()
        except FileNotFoundError:
            source = config.get("chat_template")
        except (OSError, UnicodeDecodeError) as e:
            raise ChatTemplateError(f"{path} cannot be read: {e}") from None
        if isinstance(source, list):  # named templates: the default one
            source = next((t.get("template") for t in source if isinstance(t, dict) and t.get("name") == "default"),
                          None)
        if not isinstance(source, str) or not source:
            return None
        special = {}
        for tokens in (config, read_json(folder / "special_tokens_map.json")):  # (the map wins, as in transformers)
            for name in SPECIAL_TOKENS:
                token = tokens.get(name)
                token = token.get("content") if isinstance(token, dict) else token
                if isinstance(token, str):
                    special[name] = token
        return cls(source, special)

    def render(self, messages: list[dict], add_generation_prompt: bool = True, kwargs: Optional[dict] = None,
               continue_final_message: bool = False) -> str:
        """The conversation as the model's prompt text; ChatTemplateError where the template
        refuses it. ``kwargs`` (chat_template_kwargs) cannot replace what this passes.
        ``continue_final_message``: the text ends inside the last message, where its content
        ends (what the template writes after it cut off), for the model to go on with it."""
        if not continue_final_message:
            return self._render(messages, add_generation_prompt, kwargs)
        return self._continued(messages, add_generation_prompt, kwargs)

    def _continued(self, messages: list[dict], add_generation_prompt: bool, kwargs: Optional[dict]) -> str:
        """As transformers' render_jinja_template continues the final message (vLLM's server
        renders with it): a tag after the last content, the text cut where the tag is, and before
        whitespace the template trimmed off that content's end."""
        if not self.reads_content:
            raise ChatTemplateError('continue_final_message is set to "content" but this is not an accepted field '
                                    "in the chat_template")
        final = messages[-1]["content"]
        rendered = self._render([*messages[:-1], {**messages[-1], "content": final + CONTINUE_TAG}],
                                add_generation_prompt, kwargs)
        tag = CONTINUE_TAG.strip()
        if final.strip() not in rendered or tag not in rendered:
            raise ChatTemplateError("continue_final_message is set but the final message does not appear in the chat "
                                    "after applying the chat template: the template deletes portions of it")
        at = rendered.rindex(tag)
        return rendered[:at] if rendered.startswith(CONTINUE_TAG, at) else rendered[:at].rstrip()

    def _render(self, messages: list[dict], add_generation_prompt: bool, kwargs: Optional[dict]) -> str:
        import jinja2

        if not self.knows_developer and any(m.get("role") == "developer" for m in messages):
            messages = _developer_as_system(messages)
        context = {**self.special, **(kwargs or {}), "messages": messages, "tools": None, "documents": None,
                   "add_generation_prompt": add_generation_prompt}
        try:
            return self.template.render(**context)
        except jinja2.exceptions.TemplateError as e:  # (raise_exception's too, and the sandbox's refusals)
            raise ChatTemplateError(f"the model's chat template refused the conversation: {e}") from None
        except Exception as e:  # noqa: BLE001 -- the template's own fault (1/0, a recursion): the request's answer
            raise ChatTemplateError(f"the model's chat template failed on the conversation: "
                                    f"{type(e).__name__}: {e}") from None


CONTINUE_TAG = "CONTINUE_FINAL_MESSAGE_TAG "  # transformers' own marker: a template treats it as it does theirs


def _developer_as_system(messages: list[dict]) -> list[dict]:
    """vLLM's rewrite for a template that does not know the role: each ``developer`` message a
    ``system`` one, and every system message merged into one, first (some templates take one
    only there), their contents joined by blank lines."""
    messages = [{**m, "role": "system"} if m["role"] == "developer" else m for m in messages]
    roles = [m["role"] for m in messages]
    if roles.count("system") < 2 and roles.index("system") == 0:
        return messages
    system = "\n\n".join(m["content"] for m in messages if m["role"] == "system" and m["content"])
    return [{"role": "system", "content": system}, *(m for m in messages if m["role"] != "system")]
