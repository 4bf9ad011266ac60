"""The structured-output fields of a body as vLLM reads them (`structured_outputs`, OpenAI's `response_format`) -> the
constraint the engine gets, or a 400 naming the field: a schema or regex that does not compile never reaches the
engine."""

from __future__ import annotations

import json

import pytest

from hybridpd.engine.output_constraint import ConstraintKind, OutputConstraint
from hybridpd.engine.tokenizer import TokenIdsOnly
from hybridpd.errors import InvalidRequestError
from hybridpd.server.fields import Fields
from hybridpd.server.structured_fields import output_constraint

from .fake_engine import ByteTokenizer

COMPLETIONS, CHAT = "/v1/completions", "/v1/chat/completions"
USER = [{"role": "user", "content": "x"}]
SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}


@pytest.mark.parametrize("fields, expected", [
    ({}, None),
    ({"response_format": {"type": "text"}}, None),
    ({"response_format": {"type": "json_object"}}, OutputConstraint(ConstraintKind.JSON_OBJECT, "", False,
                                                                     "response_format")),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "n", "schema": SCHEMA}}},
     OutputConstraint(ConstraintKind.JSON, json.dumps(SCHEMA), False, "response_format")),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "n", "schema": json.dumps(SCHEMA)}}},
     OutputConstraint(ConstraintKind.JSON, json.dumps(SCHEMA), False, "response_format")),
    # response_format takes the place of structured_outputs' constraint; its whitespace switch stays
    ({"response_format": {"type": "json_object"}, "structured_outputs": {"regex": "a+", "disable_any_whitespace": True}},
     OutputConstraint(ConstraintKind.JSON_OBJECT, "", True, "response_format")),
    ({"structured_outputs": {"json": SCHEMA}}, OutputConstraint(ConstraintKind.JSON, json.dumps(SCHEMA))),
    ({"structured_outputs": {"json": json.dumps(SCHEMA), "disable_any_whitespace": True}},
     OutputConstraint(ConstraintKind.JSON, json.dumps(SCHEMA), True)),
    ({"structured_outputs": {"json_object": True}}, OutputConstraint(ConstraintKind.JSON_OBJECT, "")),
    ({"structured_outputs": {"regex": r"\d+", "json_object": False}}, OutputConstraint(ConstraintKind.REGEX, r"\d+")),
    ({"structured_outputs": {"choice": ["a", "b c"]}}, OutputConstraint(ConstraintKind.CHOICE, '["a", "b c"]')),
    ({"structured_outputs": {"grammar": 'start: "yes" | "no"'}},
     OutputConstraint(ConstraintKind.GRAMMAR, 'start: "yes" | "no"')),
    ({"structured_outputs": {"grammar": 'root ::= "yes" | "no"'}},   # llama.cpp's GBNF
     OutputConstraint(ConstraintKind.GRAMMAR, 'root ::= "yes" | "no"')),
])
def test_the_constraint_a_body_asks_for(fields, expected):
    assert output_constraint(Fields(fields), ByteTokenizer()) == expected


@pytest.mark.parametrize("fields, param", [
    ({"response_format": {"type": "xml"}}, "response_format.type"),
    ({"response_format": {"type": "structural_tag", "structures": []}}, "response_format.type"),
    ({"response_format": "json"}, "response_format"),
    ({"response_format": {"type": "json_schema"}}, "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "n"}}}, "response_format.json_schema.schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": "{nope"}}},
     "response_format.json_schema.schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": [1]}}}, "response_format.json_schema.schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": {"type": "nonsense"}}}}, "response_format"),
    ({"structured_outputs": {}}, "structured_outputs"),
    ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs"),
    ({"structured_outputs": {"regex": "[a-"}}, "structured_outputs"),
    ({"structured_outputs": {"regex": ""}}, "structured_outputs.regex"),
    ({"structured_outputs": {"regex": 5}}, "structured_outputs.regex"),
    ({"structured_outputs": {"choice": []}}, "structured_outputs.choice"),
    ({"structured_outputs": {"choice": "a"}}, "structured_outputs.choice"),
    ({"structured_outputs": {"choice": ["a", 1]}}, "structured_outputs.choice"),
    ({"structured_outputs": {"json": "not json"}}, "structured_outputs.json"),
    ({"structured_outputs": {"json_object": "yes"}}, "structured_outputs.json_object"),
    ({"structured_outputs": {"grammar": "start: b"}}, "structured_outputs"),
    ({"structured_outputs": {"json_object": True, "disable_any_whitespace": "no"}},
     "structured_outputs.disable_any_whitespace"),
    ({"structured_outputs": {"structural_tag": "{}"}}, "structured_outputs.structural_tag"),
    ({"structured_outputs": {"json_object": True, "whitespace_pattern": " "}}, "structured_outputs.whitespace_pattern"),
    ({"structured_outputs": {"json_object": True, "disable_additional_properties": True}},
     "structured_outputs.disable_additional_properties"),
    ({"structured_outputs": "json"}, "structured_outputs"),
])
def test_a_constraint_that_cannot_be_served_is_a_400_naming_its_field(fields, param):
    with pytest.raises(InvalidRequestError) as caught:
        output_constraint(Fields(fields), ByteTokenizer())
    assert caught.value.param == param


def test_a_node_without_a_tokenizer_refuses_a_constraint():
    with pytest.raises(InvalidRequestError) as caught:
        output_constraint(Fields({"structured_outputs": {"json_object": True}}), TokenIdsOnly(300))
    assert caught.value.param == "structured_outputs"


@pytest.mark.parametrize("path, body", [
    (COMPLETIONS, {"prompt": "x", "structured_outputs": {"choice": ["yes", "no"]}}),
    (CHAT, {"messages": USER, "response_format": {"type": "json_schema", "json_schema": {"schema": SCHEMA}}}),
    (CHAT, {"messages": USER, "stream": True, "structured_outputs": {"regex": "[0-9]+"}}),
])
async def test_the_constraint_reaches_the_engine(client, engine, path, body):
    resp = await client.post(path, json=body | {"max_tokens": 3})
    assert resp.status == 200, await resp.text()
    await resp.read()
    assert engine.requests[-1].sampling.constraint == output_constraint(Fields(body), ByteTokenizer())
    assert engine.requests[-1].sampling.constraint is not None


@pytest.mark.parametrize("path, body, param", [
    (COMPLETIONS, {"prompt": "x", "structured_outputs": {"regex": "(a"}}, "structured_outputs"),
    (CHAT, {"messages": USER, "response_format": {"type": "json_schema", "json_schema": {}}},
     "response_format.json_schema.schema"),
    (COMPLETIONS, {"prompt": "x", "guided_json": SCHEMA}, "guided_json"),   # vLLM's old spelling
    (CHAT, {"messages": USER, "guided_choice": ["a"]}, "guided_choice"),
])
async def test_a_bad_constraint_never_reaches_the_engine(client, engine, path, body, param):
    resp = await client.post(path, json=body)
    assert resp.status == 400 and (await resp.json())["error"]["param"] == param
    assert engine.requests == []
