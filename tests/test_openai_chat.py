"""/v1/chat/completions' own parts (dispatcher/openai_chat.py, chat_template.py): the chat
template renders a conversation as transformers' apply_chat_template does, and the messages
are read as vLLM reads them. The route end to end: tests/test_llm_dispatch.py."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings, strategies as st

from batchyard.chat_template import ChatTemplate, ChatTemplateError
from batchyard.openai_chat import chat_messages
from batchyard.openai_fields import OpenAiError

# Templates of the kinds models ship: Llama 2's (bos_token, raise_exception, trim), ChatML's
# (add_generation_prompt), and one with tojson, loop controls, whitespace control and a kwarg.
LLAMA = ("{{ bos_token }}{% for message in messages %}{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
         "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
         "{% if message['role'] == 'user' %}{{ '[INST] ' + message['content'] | trim + ' [/INST]' }}"
         "{% elif message['role'] == 'assistant' %}{{ ' '  + message['content'] | trim + eos_token }}{% endif %}"
         "{% endfor %}")
CHATML = ("{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>'"
          " + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
OTHER = ("{%- for m in messages %}{%- if m.role == 'system' %}{{ m.content | tojson }}{% continue %}{%- endif %}\n"
         "  {{ m.role }}: {{ m.content }}{% if m.name is defined %} ({{ m.name }}){% endif %}\n{%- endfor %}"
         "{{ '>' if add_generation_prompt }}{{ extra | default('') }}")
# transformers' own tag and globals: {% generation %}, namespace(), dict()
GENERATION = ("{% set ns = namespace(n=0) %}{% for m in messages %}{% set ns.n = ns.n + 1 %}{% if m.role == 'assistant' %}"
              "{% generation %}{{ m.content }}{{ eos_token }}{% endgeneration %}{% else %}{{ m.role }}: {{ m.content }}\n"
              "{% endif %}{% endfor %}{{ ns.n }}{{ dict(a=ns.n) | tojson }}")


def _folder(tmp_path, template) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(["the cache moves"], trainers.BpeTrainer(
        vocab_size=280, special_tokens=["<unk>", "<s>", "</s>"], show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({
        "chat_template": template, "bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>",
        "tokenizer_class": "PreTrainedTokenizerFast"}))


_messages = st.lists(st.fixed_dictionaries(
    {"role": st.sampled_from(["system", "user", "assistant", "user"]),
     "content": st.text(st.characters(codec="utf-8", exclude_categories=("Cs",)), max_size=12)},
    optional={"name": st.sampled_from(["bob", "é"])}), min_size=1, max_size=5)


@pytest.mark.parametrize("template", [LLAMA, CHATML, OTHER, GENERATION])
def test_a_conversation_renders_as_transformers_renders_it(tmp_path, template):
    """Each conversation (and add_generation_prompt, and a template kwarg) the same text as
    transformers' apply_chat_template on the same folder, or refused by both."""
    from transformers import PreTrainedTokenizerFast

    _folder(tmp_path, template)
    theirs = PreTrainedTokenizerFast.from_pretrained(str(tmp_path))
    mine = ChatTemplate.load(tmp_path)

    @settings(max_examples=60, deadline=None)
    @given(_messages, st.booleans())
    def check(messages, add_generation_prompt):
        try:
            expected = theirs.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt,
                                                  extra="X")
        except Exception as e:  # noqa: BLE001 -- the template's refusal: ours must refuse as well
            with pytest.raises(ChatTemplateError, match="refused the conversation"):
                mine.render(messages, add_generation_prompt, {"extra": "X"})
            assert "alternate" in str(e)
            return
        assert mine.render(messages, add_generation_prompt, {"extra": "X"}) == expected

    check()


# LLAMA trims the content (the tag's space goes); a template that writes no content at all
@pytest.mark.parametrize("template", [LLAMA, CHATML, OTHER, "{% for m in messages %}{{ m.role }};{% endfor %}"])
def test_a_final_message_is_continued_as_transformers_continues_it(tmp_path, template):
    """continue_final_message (vLLM's chat field; it was a 400 here): the prompt ends where the
    last message's content ends, as transformers' apply_chat_template cuts it, or is refused by
    both (a template that drops that content)."""
    from transformers import PreTrainedTokenizerFast

    _folder(tmp_path, template)
    theirs = PreTrainedTokenizerFast.from_pretrained(str(tmp_path))
    mine = ChatTemplate.load(tmp_path)

    @settings(max_examples=60, deadline=None)
    @given(_messages)
    def check(messages):
        try:
            expected = theirs.apply_chat_template(messages, tokenize=False, continue_final_message=True, extra="X")
        except Exception:  # noqa: BLE001 -- transformers' refusal (or the template's): ours must refuse as well
            with pytest.raises(ChatTemplateError):
                mine.render(messages, False, {"extra": "X"}, continue_final_message=True)
            return
        assert mine.render(messages, False, {"extra": "X"}, continue_final_message=True) == expected

    check()
    if template == CHATML:
        assert mine.render([{"role": "user", "content": "q"}, {"role": "assistant", "content": "The answer is"}],
                           False, continue_final_message=True).endswith("<|im_start|>assistant\nThe answer is")


def test_a_template_is_found_where_transformers_looks_and_a_broken_one_is_said_so(tmp_path):
    assert ChatTemplate.load(tmp_path) is None  # no tokenizer_config.json
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": [
        {"name": "tool_use", "template": "T"}, {"name": "default", "template": "D{{ messages | length }}"}]}))
    assert ChatTemplate.load(tmp_path).render([{"role": "user", "content": "x"}]) == "D1"  # the default one
    (tmp_path / "chat_template.jinja").write_text("J{{ eos_token | default('-') }}")  # the file wins
    assert ChatTemplate.load(tmp_path).render([]) == "J-"
    (tmp_path / "chat_template.jinja").write_text("{% for %}")
    with pytest.raises(ChatTemplateError, match="does not compile"):
        ChatTemplate.load(tmp_path)
    # the sandbox: a template cannot reach Python's internals
    (tmp_path / "chat_template.jinja").write_text("{{ messages.__class__.__mro__[1].__subclasses__() }}")
    with pytest.raises(ChatTemplateError, match="refused the conversation"):
        ChatTemplate.load(tmp_path).render([])


def test_special_tokens_come_from_the_map_over_the_config_as_transformers_takes_them(tmp_path):
    from transformers import PreTrainedTokenizerFast

    _folder(tmp_path, "{{ bos_token }}|{{ eos_token }}|{{ pad_token | default('-') }}")
    (tmp_path / "special_tokens_map.json").write_text(json.dumps({"bos_token": "</s>", "pad_token": "<unk>"}))
    expected = PreTrainedTokenizerFast.from_pretrained(str(tmp_path)).apply_chat_template(
        [{"role": "user", "content": "x"}], tokenize=False)
    assert ChatTemplate.load(tmp_path).render([{"role": "user", "content": "x"}]) == expected == "</s>|</s>|<unk>"


def test_a_developer_message_is_a_system_one_where_the_template_does_not_know_the_role(tmp_path):
    """As vLLM rewrites it: developer -> system, the system messages then merged into one, first."""
    (tmp_path / "chat_template.jinja").write_text("{% for m in messages %}[{{ m.role }}:{{ m.content }}]{% endfor %}")
    t = ChatTemplate.load(tmp_path)
    assert t.render([{"role": "developer", "content": "d"}, {"role": "user", "content": "u"}]) == "[system:d][user:u]"
    assert t.render([{"role": "system", "content": "s"}, {"role": "user", "content": "u"},
                     {"role": "developer", "content": "d"}]) == "[system:s\n\nd][user:u]"
    (tmp_path / "chat_template.jinja").write_text("{% for m in messages %}{% if m.role == 'developer' %}D{% endif %}"
                                                  "[{{ m.role }}]{% endfor %}")
    assert ChatTemplate.load(tmp_path).render([{"role": "developer", "content": "d"}]) == "D[developer]"


@pytest.mark.parametrize("source, words", [
    ("{{ 1 / 0 }}", "ZeroDivisionError"),
    ("{% macro f(n) %}{{ f(n) }}{% endmacro %}{{ f(1) }}", "RecursionError"),
    ("{% set ns = namespace() %}{% set ns._x = 1 %}", "underscore-prefixed"),
    ("{{ raise_exception('no system message here') }}", "no system message here")])
def test_a_template_that_fails_on_a_conversation_is_that_requests_error(tmp_path, source, words):
    (tmp_path / "chat_template.jinja").write_text(source)
    with pytest.raises(ChatTemplateError, match=words):
        ChatTemplate.load(tmp_path).render([{"role": "user", "content": "x"}])


def test_a_template_file_that_cannot_be_read_is_said_so(tmp_path):
    (tmp_path / "chat_template.jinja").write_bytes(b"\xff{{ 1 }}")
    with pytest.raises(ChatTemplateError, match="cannot be read"):
        ChatTemplate.load(tmp_path)


def test_messages_are_read_as_vllm_reads_them_and_what_is_not_text_is_refused():
    assert chat_messages([{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
                          {"role": "assistant", "content": None, "name": "x"}]) == [
        {"role": "user", "content": "a\nb"}, {"role": "assistant", "content": "", "name": "x"}]
    for messages, words in (([], "non-empty list"), ("hi", "non-empty list"), ([5], "messages[0] must be an object"),
                            ([{"content": "x"}], "messages[0].role"),
                            ([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "u"}}]}],
                             "messages[0].content[0]: only text parts"),
                            ([{"role": "user", "content": 5}], "content must be a string or a list"),
                            ([{"role": "user", "content": "x"}, {"role": "tool", "content": "y"}],
                             "messages[1]: tool calls"),
                            ([{"role": "user", "content": "x", "name": 3}], "messages[0].name"),
                            ([{"role": "user", "content": "x"}] * 1025, "at most 1024"),
                            ([{"role": "x" * (1 << 21), "content": "x"}], "characters"),
                            ([{"role": "user", "content": "x" * (1 << 21)}], "characters")):
        with pytest.raises(OpenAiError) as e:
            chat_messages(messages)
        assert e.value.status == 400 and words in e.value.message and e.value.param == "messages", (
            messages, e.value.message)


def test_reasoning_effort_and_the_template_kwargs_reach_the_template_as_vllm_passes_them(tmp_path):
    import asyncio
    from types import SimpleNamespace

    from batchyard.openai_chat import OpenAiChat

    (tmp_path / "chat_template.jinja").write_text("{{ reasoning_effort }}|{{ enable_thinking }}|{{ x | default('') }}")
    chat = OpenAiChat(SimpleNamespace(models={"m": str(tmp_path)}))
    text = lambda **body: asyncio.run(chat.prompt_text({"messages": [{"role": "user", "content": "q"}], **body}, "m"))  # noqa: E731
    assert text(reasoning_effort="low") == "low|True|"
    assert text(reasoning_effort="none", chat_template_kwargs={"x": 1}) == "none|False|1"
    assert text(reasoning_effort="high", chat_template_kwargs={"enable_thinking": False}) == "high|False|"
    assert text() == "||"  # (undefined: empty, as jinja2 renders them)
