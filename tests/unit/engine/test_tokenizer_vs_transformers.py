"""Our tokenizer against `AutoTokenizer.from_pretrained(dir)` on every preset (offline): encode (what `/tokenize`
returns), decode, and the chat template rendered for `/v1/chat/completions`."""

from __future__ import annotations

import pytest
from transformers import AutoTokenizer

from hybridpd.presets.checkpoints import PRESETS
from hybridpd.presets.tokenizer import write_tokenizer
from hybridpd.presets.shapes import VOCAB_SIZES
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
