"""What a request's output must match (vLLM's structured outputs): a JSON schema, any JSON object, a regular
expression, one of a list of strings, or a grammar (Lark, or llama.cpp's GBNF), compiled to an llguidance grammar as
vLLM's `guidance` backend compiles it (JSON with flexible whitespace unless `disable_any_whitespace`).

A constraint is data (it crosses to the engine process with the request); the matcher that follows a request's
tokens through it is the engine's (grammar.py). `check()` raises `InvalidRequestError` for a constraint that does
not compile (a schema of an unknown type, a regex that does not parse), so a bad one is a 400, never a failed step.
"""

from __future__ import annotations

import enum
import json
from dataclasses import dataclass
from typing import Any

import llguidance

from hybridpd.errors import InvalidRequestError


class ConstraintKind(enum.Enum):
    JSON = "json"                 # a JSON schema
    JSON_OBJECT = "json_object"   # any JSON object
    REGEX = "regex"
    CHOICE = "choice"             # exactly one of a list of strings
    GRAMMAR = "grammar"           # Lark or GBNF


@dataclass(frozen=True)
class OutputConstraint:
    kind: ConstraintKind
    spec: str                     # the schema (JSON text), the regex, the choices (a JSON list) or the grammar
    disable_any_whitespace: bool = False   # JSON only: no whitespace between tokens the schema does not need
    field: str = "structured_outputs"      # the request field it came from (named in errors)

    def check(self) -> None:
        """That the grammar compiles (where the request is parsed: a bad one never reaches the engine)."""
        is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(self.grammar())
        if is_error:
            raise InvalidRequestError(f"{self.kind.value}: {_message(messages[0])}", self.field)

    def grammar(self) -> str:
        """The llguidance grammar of this constraint (what a matcher is built from; `check()` says it compiles)."""
        try:
            return self._grammar()
        except ValueError as exc:
            raise InvalidRequestError(f"{self.kind.value}: {_message(str(exc))}", self.field) from None

    def _grammar(self) -> str:
        whitespace = {"whitespace_flexible": not self.disable_any_whitespace}
        if self.kind is ConstraintKind.JSON:
            return llguidance.LLMatcher.grammar_from_json_schema(self.spec, defaults=whitespace)
        if self.kind is ConstraintKind.JSON_OBJECT:
            return llguidance.LLMatcher.grammar_from_json_schema('{"type": "object"}', defaults=whitespace)
        return llguidance.grammar_from(self.kind.value, self.spec)


def _message(message: str) -> str:
    """An llguidance message's first line and its `error:` line (the others point into the grammar's text)."""
    lines = [line.strip() for line in message.strip().splitlines() if line.strip()]
    kept = lines[:1] + [line for line in lines[1:] if line.startswith("error:")]
    return " ".join(kept)[:300] if kept else "does not compile"


def json_text(value: Any, field: str) -> str:
    """A schema given as an object or as JSON text -> its JSON text (an object, checked)."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError:
            raise InvalidRequestError("the JSON schema is not valid JSON", field) from None
    if not isinstance(value, dict):
        raise InvalidRequestError("the JSON schema must be an object", field)
    return json.dumps(value)
