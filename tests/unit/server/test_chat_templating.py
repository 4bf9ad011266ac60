"""Which chat template renders a request (server/chat_templating.py): `--chat-template` (a file or the template
itself), a request's own template only under `--trust-request-chat-template` (else refused with vLLM's message),
and `--default-chat-template-kwargs` under the request's own variables; through chat, /tokenize, Responses and
Messages."""

from __future__ import annotations


import pytest
from aiohttp.test_utils import TestClient, TestServer

from hybridpd.engine.tokenizer import ByteTokenizer, load_tokenizer
from hybridpd.presets.checkpoints import write_checkpoint
from hybridpd.server.args import BadArgumentsError
from hybridpd.server.chat_templating import UNTRUSTED, ChatTemplating

from .conftest import MODEL, make_app, serve_configs as configs
from .fake_engine import FakeEngine

USER = [{"role": "user", "content": "x"}]
BRACKETS = "{% for m in messages %}[{{ m.role }}]{{ m.content }}{% endfor %}"
GREETING = "{{ greeting | default('none') }}:" + BRACKETS


async def prompt_or_error(templating: ChatTemplating, path: str, body: dict) -> tuple[int, bytes | dict]:
    """(status, the prompt the engine got or /tokenize answered, as bytes) or (status, the error body)."""
    engine = FakeEngine(tokenizer=ByteTokenizer(260))
    client = TestClient(TestServer(make_app(engine, templating=templating)))
    await client.start_server()
    try:
        resp = await client.post(path, json=body)
        out = await resp.json()
        if resp.status != 200:
            return resp.status, out
        if path == "/tokenize":
            return 200, bytes(out["tokens"])
        return 200, bytes(engine.requests[0].prompt_token_ids)
    finally:
        await client.close()


TRUSTED = ChatTemplating(trust_request_template=True)
DEFAULTS = ChatTemplating(default_kwargs=(("greeting", "hello"),))


@pytest.mark.parametrize("templating, path, body, prompt", [
    # the server's own template (the byte tokenizer's plain one) unless a trusted request sends its own
    (ChatTemplating(), "/v1/chat/completions", {"messages": USER}, b"user: x\nassistant: "),
    (TRUSTED, "/v1/chat/completions", {"messages": USER, "chat_template": BRACKETS}, b"[user]x"),
    (TRUSTED, "/v1/chat/completions", {"messages": USER, "chat_template_kwargs": {"chat_template": BRACKETS}},
     b"[user]x"),
    (TRUSTED, "/v1/chat/completions",   # the body's field before the variable's
     {"messages": USER, "chat_template": BRACKETS, "chat_template_kwargs": {"chat_template": "other"}}, b"[user]x"),
    (TRUSTED, "/tokenize", {"messages": USER, "chat_template": BRACKETS}, b"[user]x"),
    (TRUSTED, "/v1/responses", {"input": "x", "chat_template_kwargs": {"chat_template": BRACKETS}}, b"[user]x"),
    (TRUSTED, "/v1/messages", {"model": MODEL, "messages": USER, "max_tokens": 1,
                               "chat_template_kwargs": {"chat_template": BRACKETS}}, b"[user]x"),
    # the server's default variables, under the request's own
    (DEFAULTS, "/tokenize", {"messages": USER, "chat_template": GREETING}, None),
    (ChatTemplating(True, (("greeting", "hello"),)), "/tokenize", {"messages": USER, "chat_template": GREETING},
     b"hello:[user]x"),
    (ChatTemplating(True, (("greeting", "hello"),)), "/v1/chat/completions",
     {"messages": USER, "chat_template": GREETING, "chat_template_kwargs": {"greeting": "hi"}}, b"hi:[user]x"),
])
async def test_the_template_a_request_is_rendered_with(templating, path, body, prompt):
    body = {"max_tokens": 1, **body} if path == "/v1/chat/completions" else body
    status, got = await prompt_or_error(templating, path, body)
    if prompt is None:   # refused: a request's own template is not trusted
        assert status == 400 and got["error"]["message"] == UNTRUSTED and got["error"]["param"] == "chat_template"
    else:
        assert (status, got) == (200, prompt)


@pytest.mark.parametrize("path, body", [
    ("/v1/chat/completions", {"messages": USER, "chat_template": BRACKETS}),
    ("/v1/chat/completions", {"messages": USER, "chat_template_kwargs": {"chat_template": BRACKETS}}),
    ("/tokenize", {"messages": USER, "chat_template": BRACKETS}),
    ("/v1/responses", {"input": "x", "chat_template_kwargs": {"chat_template": BRACKETS}}),
])
async def test_a_request_template_is_refused_unless_trusted(path, body):
    status, error = await prompt_or_error(ChatTemplating(), path, body)
    assert status == 400 and UNTRUSTED in error["error"]["message"]


@pytest.mark.parametrize("body, param", [
    ({"messages": USER, "chat_template": "{% for %}"}, "chat_template"),         # does not compile
    ({"messages": USER, "chat_template": 7}, "chat_template"),
    ({"messages": USER, "chat_template_kwargs": {"chat_template": ["x"]}}, "chat_template_kwargs.chat_template"),
    ({"messages": USER, "chat_template": "{{ raise_exception('no') }}"}, "messages"),   # the template refuses
])
async def test_a_bad_request_template_is_a_400(body, param):
    status, error = await prompt_or_error(TRUSTED, "/v1/chat/completions", {"max_tokens": 1, **body})
    assert status == 400 and error["error"]["param"] == param


def test_chat_template_flag_reads_a_file_or_takes_the_template(tmp_path):
    (tmp_path / "t.jinja").write_text(BRACKETS)
    assert configs(["--chat-template", str(tmp_path / "t.jinja")]).server.chat_template == BRACKETS
    assert configs(["--chat-template", BRACKETS]).server.chat_template == BRACKETS
    assert configs([]).server.chat_template is None
    c = configs(["--trust-request-chat-template", "--default-chat-template-kwargs", '{"enable_thinking": false}'])
    assert c.server.templating == ChatTemplating(True, (("enable_thinking", False),))


@pytest.mark.parametrize("argv, words", [
    (["--chat-template", "/no/such/template.jinja"], "looks like a file's path"),
    (["--chat-template", "{% for %}"], "does not compile"),
    (["--default-chat-template-kwargs", "[1]"], "must be a JSON object"),
    (["--default-chat-template-kwargs", "{"], "is not JSON"),
    (["--default-chat-template-kwargs", '{"messages": []}'], "may not set messages"),
    (["--default-chat-template-kwargs", '{"chat_template": "x"}'], "may not set chat_template"),
])
def test_bad_template_flags_are_refused(argv, words):
    with pytest.raises(BadArgumentsError, match=words):
        configs(argv)


def test_the_flag_replaces_the_checkpoints_template(tmp_path):
    """A checkpoint's own tokenizer with --chat-template: the template renders, sees the special tokens as
    transformers passes them, and /tokenizer_info reports it."""
    model_dir = write_checkpoint("tiny", tmp_path / "m")
    own = load_tokenizer(model_dir, 512)
    source = "{{ bos_token }}|" + BRACKETS
    replaced = load_tokenizer(model_dir, 512, chat_template=source)
    assert replaced.describe()["chat_template"] == source
    bos = own.describe().get("bos_token") or ""
    assert replaced.apply_chat_template(USER, True) == f"{bos}|[user]x"
    assert own.apply_chat_template(USER, True) != replaced.apply_chat_template(USER, True)
    assert replaced.encode("[user]x", add_special_tokens=False) == own.encode("[user]x", add_special_tokens=False)


def test_a_byte_tokenizer_takes_a_template_too():
    plain = ByteTokenizer(260)
    assert plain.apply_chat_template(USER, True) == "user: x\nassistant: "
    assert plain.with_chat_template(BRACKETS).apply_chat_template(USER, True) == "[user]x"
    assert plain.describe()["chat_template"] is None
