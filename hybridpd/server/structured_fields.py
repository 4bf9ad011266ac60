"""A request body's structured-output fields -> an `OutputConstraint`, as vLLM reads them:

- `structured_outputs`: exactly one of `json` (a schema, an object or its JSON text), `regex`, `choice` (a list of
  strings), `grammar` (Lark or GBNF), `json_object: true`; beside it `disable_any_whitespace`;
- `response_format` (OpenAI's): `{"type": "json_object"}`, or `{"type": "json_schema", "json_schema": {"name": ...,
  "schema": {...}}}`; it takes the place of `structured_outputs`' constraint, as in vLLM. `{"type": "text"}` asks
  for nothing.

The constraint is compiled here once (a schema or regex that does not compile is a 400 naming the field, before the
request reaches the engine). Not served, and refused by name: `structural_tag`, `whitespace_pattern`,
`disable_additional_properties` (vLLM's, set by its server's flags); the `guided_*` fields vLLM read before it
spelled them `structured_outputs` are refused with the other fields we do not read (sampling_fields.UNSUPPORTED).
"""

from __future__ import annotations

import json
from typing import Any

from hybridpd.engine.output_constraint import ConstraintKind, OutputConstraint, json_text
from hybridpd.engine.tokenizer import NO_TOKENIZER, Tokenizer
from hybridpd.errors import InvalidRequestError
from hybridpd.server.fields import Fields

KINDS = ("json", "regex", "choice", "grammar", "json_object")
NOT_SERVED = ("structural_tag", "whitespace_pattern")


def output_constraint(f: Fields, tokenizer: Tokenizer) -> OutputConstraint | None:
    constraint = _from_response_format(f) or _from_structured_outputs(f)
    if constraint is None:
        return None
    if not tokenizer.decodes_text:
        raise InvalidRequestError(f"{NO_TOKENIZER}: structured outputs need the tokenizer", constraint.field)
    constraint.check()   # compiles, or a 400 naming the field
    return constraint


def _from_structured_outputs(f: Fields) -> OutputConstraint | None:
    so = f.optional_object("structured_outputs")
    if so is None:
        return None
    field = "structured_outputs"
    for name in NOT_SERVED:
        if so.raw(name) is not None:
            raise so.fail(name, "is not supported")
    if so.bool("disable_additional_properties", False):
        raise so.fail("disable_additional_properties", "is not supported")
    given = [kind for kind in KINDS if so.raw(kind) is not None and not (kind == "json_object" and
                                                                       so.raw(kind) is False)]
    if len(given) != 1:
        raise InvalidRequestError(
            "structured_outputs must hold exactly one of json, regex, choice, grammar, json_object; got "
            f"{', '.join(given) or 'none'}", field)
    kind = given[0]
    spaces = so.bool("disable_any_whitespace", False)
    if kind == "json":
        return OutputConstraint(ConstraintKind.JSON, json_text(so.raw("json"), "structured_outputs.json"), spaces)
    if kind == "json_object":
        if so.raw("json_object") is not True:
            raise so.fail("json_object", "must be true")
        return OutputConstraint(ConstraintKind.JSON_OBJECT, "", spaces)
    if kind == "choice":
        choices = so.raw("choice")
        if not isinstance(choices, list) or not choices or not all(isinstance(c, str) for c in choices):
            raise so.fail("choice", "must be a non-empty list of strings")
        return OutputConstraint(ConstraintKind.CHOICE, json.dumps(choices), spaces)
    text = so.optional_str(kind)
    if not text:
        raise so.fail(kind, "must be a non-empty string")
    return OutputConstraint(ConstraintKind.REGEX if kind == "regex" else ConstraintKind.GRAMMAR, text, spaces)


def _from_response_format(f: Fields) -> OutputConstraint | None:
    rf = f.optional_object("response_format")
    if rf is None:
        return None
    field = "response_format"
    kind = rf.optional_str("type")
    so = f.optional_object("structured_outputs")
    spaces = so is not None and so.bool("disable_any_whitespace", False)
    if kind == "text":
        return None
    if kind == "json_object":
        return OutputConstraint(ConstraintKind.JSON_OBJECT, "", spaces, field)
    if kind == "json_schema":
        spec = rf.optional_object("json_schema")
        if spec is None:
            raise InvalidRequestError(
                "When response_format type is 'json_schema', the 'json_schema' field must be provided.", field)
        schema: Any = spec.raw("schema")
        if schema is None:
            raise spec.fail("schema", "must be given (the JSON schema the output follows)")
        return OutputConstraint(ConstraintKind.JSON, json_text(schema, "response_format.json_schema.schema"),
                                spaces, field)
    raise rf.fail("type", f"must be one of text, json_object, json_schema; got {kind!r}")
