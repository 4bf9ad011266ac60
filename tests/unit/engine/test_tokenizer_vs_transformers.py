"""Our tokenizer against `AutoTokenizer.from_pretrained(dir)` on every preset (offline): encode (what `/tokenize`
returns), decode, and the chat template rendered for `/v1/chat/completions`."""

from __future__ import annotations

import json

import pytest
from transformers import AutoTokenizer

from hybridpd.presets.checkpoints import PRESETS
from hybridpd.presets.tokenizer import write_tokenizer
from hybridpd.presets.shapes import VOCAB_SIZES
from hybridpd.engine.continued_chat import render_continuing
from hybridpd.engine.tokenizer import load_tokenizer

TEXTS = [
    "Hello world, the cache block!",
    "café naïve über — €5 ½ 日本語",
    "  leading spaces, tabs\tand\nnew lines\n\n",
    "<|end_of_text|> a special token inside text <|start_of_role|>user<|end_of_role|>",
    "",
    "1234567890 3.14159 x=y+z; {\"json\": [1, 2]}",
    "🙂 emoji and \u200b zero width",
]
CONVERSATIONS = [
    [{"role": "user", "content": "hi there"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is a prefix cache?"},
     {"role": "assistant", "content": "A cache of computed prefixes."}, {"role": "user", "content": "And P/D?"}],
]


@pytest.fixture(scope="module", params=sorted({VOCAB_SIZES[p] for p in PRESETS}), ids=lambda v: f"vocab{v}")
def pair(request, tmp_path_factory):
    out = tmp_path_factory.mktemp("tok")
    write_tokenizer(out, request.param, 4096)
    return load_tokenizer(out, request.param), AutoTokenizer.from_pretrained(out)


@pytest.mark.parametrize("text", TEXTS)
def test_encode_and_decode_equal_transformers(pair, text, monkeypatch):
    ours, theirs = pair
    ids = ours.encode(text)
    assert ids == theirs(text)["input_ids"]
    assert ours.encode(text, add_special_tokens=False) == theirs(text, add_special_tokens=False)["input_ids"]
    assert ours.decode(ids) == theirs.decode(ids, skip_special_tokens=True)


@pytest.mark.parametrize("messages", CONVERSATIONS)
def test_chat_template_renders_as_transformers(pair, messages):
    ours, theirs = pair
    rendered = ours.apply_chat_template(messages)
    assert rendered == theirs.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert ours.encode(rendered, add_special_tokens=False) == theirs.apply_chat_template(
        messages, tokenize=True, add_generation_prompt=True, return_dict=True)["input_ids"]


def test_special_tokens_are_single_ids(pair):
    ours, theirs = pair
    assert ours.eos_token_id == theirs.eos_token_id
    assert len(ours.encode("<|end_of_text|>")) == 1


def test_a_post_processor_that_adds_bos_is_honoured(tmp_path):
    """Llama-style tokenizers add BOS through tokenizer.json's post-processor: `/tokenize` has it, chat does not
    add a second one (the rendered template starts with its own)."""
    from tokenizers import Tokenizer, processors

    write_tokenizer(tmp_path, 512, 4096)
    tokenizer = Tokenizer.from_file(str(tmp_path / "tokenizer.json"))
    bos = tokenizer.token_to_id("<|start_of_role|>")
    tokenizer.post_processor = processors.TemplateProcessing(
        single="<|start_of_role|> $A", pair="<|start_of_role|> $A $B", special_tokens=[("<|start_of_role|>", bos)])
    tokenizer.save(str(tmp_path / "tokenizer.json"))
    ours, theirs = load_tokenizer(tmp_path, 512), AutoTokenizer.from_pretrained(tmp_path)
    for text in TEXTS:
        assert ours.encode(text) == theirs(text)["input_ids"]
        assert ours.encode(text)[:1] == [bos]
    messages = CONVERSATIONS[1]
    assert ours.encode(ours.apply_chat_template(messages), add_special_tokens=False) == theirs.apply_chat_template(
        messages, tokenize=True, add_generation_prompt=True, return_dict=True)["input_ids"]


@pytest.mark.parametrize("text", TEXTS)
def test_token_strings_and_decoding_with_special_tokens_equal_transformers(pair, text):
    """What `/tokenize` with return_token_strs and `/detokenize` answer, as vLLM answers them with transformers."""
    ours, theirs = pair
    ids = ours.encode(text)
    assert ours.token_strings(ids) == theirs.convert_ids_to_tokens(ids)
    assert ours.decode(ids, skip_special_tokens=False) == theirs.decode(ids)


@pytest.mark.parametrize("messages", CONVERSATIONS)
def test_chat_template_without_the_generation_prompt_renders_as_transformers(pair, messages):
    ours, theirs = pair
    assert ours.apply_chat_template(messages, add_generation_prompt=False) == theirs.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=False)


def test_describe_names_what_transformers_loads(pair, tmp_path):
    """`/tokenizer_info` of a tokenizer transformers saved: lm-evaluation-harness's remote tokenizer reads its special
    tokens and chat template; vLLM names the class transformers loads."""
    _, theirs = pair
    theirs.save_pretrained(tmp_path)
    info = load_tokenizer(tmp_path, theirs.vocab_size).describe()
    assert info["tokenizer_class"] == type(theirs).__name__
    assert (info["eos_token"], info["bos_token"]) == (theirs.eos_token, theirs.bos_token)
    assert info["chat_template"] == theirs.chat_template


def test_template_kwargs_render_as_transformers_passes_them(tmp_path):
    """vLLM's `chat_template_kwargs` reach the template as transformers' `apply_chat_template(**kwargs)` passes them."""
    write_tokenizer(tmp_path, 320, 4096)
    (tmp_path / "chat_template.jinja").write_text(
        "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}"
        "{% if add_generation_prompt %}<assistant>{% if thinking %}<think>{{ budget }}{% endif %}{% endif %}")
    ours, theirs = load_tokenizer(tmp_path, 320), AutoTokenizer.from_pretrained(tmp_path)
    for kwargs in ({}, {"thinking": True, "budget": 12}, {"thinking": False}):
        assert ours.apply_chat_template(CONVERSATIONS[0], template_kwargs=kwargs) == theirs.apply_chat_template(
            CONVERSATIONS[0], tokenize=False, add_generation_prompt=True, **kwargs)


TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "The weather in a city",
                                           "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                          "required": ["city"]}}},
         {"type": "function", "function": {"name": "now", "description": "The time, ünïcode"}}]
TOOL_CONVERSATION = [
    {"role": "user", "content": "Weather in Zürich?"},
    {"role": "assistant", "content": "", "tool_calls": [
        {"id": "call-1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Zürich"}}}]},
    {"role": "tool", "tool_call_id": "call-1", "content": "sunny, 21 °C"},
]


@pytest.mark.parametrize("messages", [CONVERSATIONS[0], TOOL_CONVERSATION])
def test_tools_render_as_transformers_passes_them(pair, messages):
    """The tools and an assistant's calls in the history, as `apply_chat_template(tools=...)` renders them (the
    server hands the template what vLLM hands it: tool dicts, calls with arguments as objects)."""
    ours, theirs = pair
    rendered = ours.apply_chat_template(messages, tools=TOOLS)
    assert rendered == theirs.apply_chat_template(messages, tools=TOOLS, tokenize=False, add_generation_prompt=True)
    assert "<tools>" in rendered and '"get_weather"' in rendered
    assert ours.encode(rendered, add_special_tokens=False) == theirs.apply_chat_template(
        messages, tools=TOOLS, tokenize=True, add_generation_prompt=True, return_dict=True)["input_ids"]


CONTINUED = [
    [{"role": "user", "content": "Name a colour."}, {"role": "assistant", "content": "The colour is"}],
    [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Well,  "}],   # trailing spaces
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "x"},
     {"role": "assistant", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}],
    [{"role": "user", "content": "continue me"}],                                        # not an assistant's
]


@pytest.mark.parametrize("messages", CONTINUED)
def test_a_continued_final_message_renders_as_transformers(pair, messages):
    """`continue_final_message`: the same prompt as transformers' (the final message open, no end of turn)."""
    ours, theirs = pair
    expected = messages
    if isinstance(messages[-1]["content"], list):   # transformers continues the last text part; ours joins parts
        expected = [*messages[:-1], {**messages[-1], "content": "".join(p["text"] for p in messages[-1]["content"])}]
    rendered = render_continuing(ours, messages)
    assert rendered == theirs.apply_chat_template(expected, tokenize=False, add_generation_prompt=False,
                                                  continue_final_message=True)
    assert not rendered.endswith("<|end_of_text|>\n")


def test_a_template_that_trims_the_message_is_continued_as_transformers(tmp_path):
    """A template that strips the message's text loses the tag's space: the rendering is cut before the whitespace,
    as transformers cuts it."""
    write_tokenizer(tmp_path, 512, 4096)
    config_path = tmp_path / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config["chat_template"] = ("{% for m in messages %}<|start_of_role|>{{ m.role }}<|end_of_role|>"
                               "{{ m.content | trim }}<|end_of_text|>\n{% endfor %}")
    config_path.write_text(json.dumps(config))
    (tmp_path / "chat_template.jinja").unlink(missing_ok=True)
    ours, theirs = load_tokenizer(tmp_path, 512), AutoTokenizer.from_pretrained(tmp_path)
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "  It is  "}]
    assert render_continuing(ours, messages) == theirs.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=False, continue_final_message=True)
    assert render_continuing(ours, messages).endswith("<|end_of_role|>It is")
