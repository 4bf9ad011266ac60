"""Tokenizers: byte round trips, incomplete UTF-8, chat templates, a checkpoint's tokenizer.json."""

from __future__ import annotations

import json

import pytest
from tokenizers import Tokenizer as RustTokenizer
from tokenizers import models, pre_tokenizers, trainers

from hybridpd.engine.tokenizer import ByteTokenizer, HFTokenizer, TokenIdsOnly, load_tokenizer
from hybridpd.errors import InvalidRequestError


@pytest.mark.parametrize("text", ["", "hello", "héllo wörld", "日本語 ✓", "emoji 🙂 tab\t newline\n", "\x00nul"])
def test_byte_round_trip(text):
    tok = ByteTokenizer(258)
    ids = tok.encode(text)
    assert ids == list(text.encode("utf-8"))
    assert all(0 <= i < 256 for i in ids)
    assert tok.decode(ids) == text


@pytest.mark.parametrize("ids, expected", [
    ([0xE6, 0x97], "\ufffd"),                 # an incomplete 3-byte character
    ([104, 105, 0xF0, 0x9F], "hi\ufffd"),     # an incomplete emoji at the end
    ([104, 256, 105, 257, 300], "hi"),         # special and out-of-byte ids decode to nothing
])
def test_byte_decode_is_graceful(ids, expected):
    assert ByteTokenizer(512).decode(ids) == expected


@pytest.mark.parametrize("messages, expected", [
    ([{"role": "user", "content": "hi"}], "user: hi\nassistant: "),
    ([{"role": "system", "content": "be brief"}, {"role": "user", "content": [{"type": "text", "text": "a"},
      {"type": "text", "text": "b"}]}], "system: be brief\nuser: ab\nassistant: "),
    ([], "assistant: "),
])
def test_plain_chat_template(messages, expected):
    assert ByteTokenizer(258).apply_chat_template(messages) == expected


@pytest.mark.parametrize("messages", [[{"content": "no role"}], [{"role": "user", "content": 5}], ["text"],
                                      [{"role": "user", "content": [{"type": "image_url"}]}]])
def test_bad_messages(messages):
    with pytest.raises(InvalidRequestError):
        ByteTokenizer(258).apply_chat_template(messages)


def test_byte_tokenizer_from_checkpoint_dir(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"eos_token_id": 256, "bos_token_id": 257}))
    tok = load_tokenizer(tmp_path, 258)
    assert isinstance(tok, ByteTokenizer)
    assert (tok.eos_token_id, tok.vocab_size) == (256, 258)
    assert load_tokenizer(tmp_path / "missing", 300).eos_token_id == 256


def test_skip_init_loads_no_tokenizer(tmp_path):
    """--skip-tokenizer-init: the directory's tokenizer is not read; what needs text is refused as a bad request."""
    (tmp_path / "config.json").write_text(json.dumps({"eos_token_id": 256}))
    tok = load_tokenizer(tmp_path, 300, skip_init=True)
    assert isinstance(tok, TokenIdsOnly) and not tok.decodes_text
    assert (tok.vocab_size, tok.eos_token_id, tok.decode([72, 105])) == (300, None, "")
    with pytest.raises(InvalidRequestError) as text:
        tok.encode("hi")
    with pytest.raises(InvalidRequestError) as chat:
        tok.apply_chat_template([{"role": "user", "content": "hi"}])
    assert (text.value.param, chat.value.param) == ("prompt", "messages")
    assert load_tokenizer(tmp_path, 300).decodes_text


def test_byte_tokenizer_rejects_small_vocab():
    with pytest.raises(ValueError):
        ByteTokenizer(100)


@pytest.fixture
def hf_dir(tmp_path):
    tok = RustTokenizer(models.WordLevel(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    trainer = trainers.WordLevelTrainer(special_tokens=["<unk>", "<eos>", "<bos>"])
    tok.train_from_iterator(["the cat sat on the mat", "user: assistant: hello world"], trainer)
    tok.save(str(tmp_path / "tokenizer.json"))
    template = (
        "{{ bos_token }}{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{{ eos_token }}{% endfor %}"
        "{% if add_generation_prompt %}<assistant>{% endif %}"
    )
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({
        "eos_token": {"content": "<eos>"}, "bos_token": "<bos>", "chat_template": template,
    }))
    return tmp_path


def test_hf_tokenizer(hf_dir):
    tok = load_tokenizer(hf_dir, 64)
    assert isinstance(tok, HFTokenizer)
    assert tok.eos_token_id == tok.token_to_id("<eos>")
    ids = tok.encode("the cat sat on the mat")
    assert len(ids) == 6 and ids[0] == ids[4]
    assert tok.decode(ids) == "the cat sat on the mat"
    rendered = tok.apply_chat_template([{"role": "user", "content": "hi"}])
    assert rendered == "<bos><user>hi<eos><assistant>"


def test_hf_tokenizer_eos_from_config_json(hf_dir):
    (hf_dir / "config.json").write_text(json.dumps({"eos_token_id": 2}))
    assert load_tokenizer(hf_dir, 64).eos_token_id == 2


def test_hf_tokenizer_without_template_uses_plain(hf_dir):
    (hf_dir / "tokenizer_config.json").write_text("{}")
    assert load_tokenizer(hf_dir, 64).apply_chat_template([{"role": "user", "content": "x"}]) == "user: x\nassistant: "
