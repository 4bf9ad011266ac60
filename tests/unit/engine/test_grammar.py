"""The engine's matchers on a byte tokenizer (ids 0..255 the bytes, then specials), where what each step allows is
known by hand: the masks, the tokens taken and refused, the logits masked (a vocabulary wider than the tokenizer's
masked past it)."""

from __future__ import annotations

import json

import pytest
import torch

from hybridpd.engine.grammar import GrammarCompiler, mask_rows_
from hybridpd.engine.output_constraint import ConstraintKind, OutputConstraint
from hybridpd.engine.tokenizer import ByteTokenizer, TokenIdsOnly
from hybridpd.errors import InvalidRequestError

EOS = 256
VOCAB = 300


def compiler() -> GrammarCompiler:
    return GrammarCompiler(ByteTokenizer(VOCAB, eos_token_id=EOS), VOCAB)


def allowed(grammar) -> set[int]:
    logits = torch.zeros(1, VOCAB)
    mask_rows_(logits, [0], [grammar])
    return {int(t) for t in torch.nonzero(logits[0] == 0).flatten()}


@pytest.mark.parametrize("constraint, written, expected", [
    (OutputConstraint(ConstraintKind.CHOICE, json.dumps(["yes", "no"])), b"", {ord("y"), ord("n")}),
    (OutputConstraint(ConstraintKind.CHOICE, json.dumps(["yes", "no"])), b"ye", {ord("s")}),
    (OutputConstraint(ConstraintKind.CHOICE, json.dumps(["yes", "no"])), b"yes", {EOS}),
    (OutputConstraint(ConstraintKind.CHOICE, json.dumps(["a", "ab"])), b"a", {ord("b"), EOS}),
    (OutputConstraint(ConstraintKind.REGEX, "[0-2]x"), b"", {ord("0"), ord("1"), ord("2")}),
    (OutputConstraint(ConstraintKind.REGEX, "[0-2]x"), b"1", {ord("x")}),
    (OutputConstraint(ConstraintKind.GRAMMAR, 'start: "<" ("a" | "b")+ ">"'), b"<a", {ord("a"), ord("b"), ord(">")}),
    (OutputConstraint(ConstraintKind.JSON, json.dumps({"enum": [1, 2]}), disable_any_whitespace=True), b"",
     {ord("1"), ord("2")}),
    (OutputConstraint(ConstraintKind.JSON_OBJECT, "", disable_any_whitespace=True), b"", {ord("{")}),
])
def test_what_each_step_allows(constraint, written, expected):
    grammar = compiler().start(constraint)
    for byte in written:
        assert grammar.accept(byte)
    assert allowed(grammar) == expected


def test_a_token_the_grammar_does_not_allow_is_refused():
    grammar = compiler().start(OutputConstraint(ConstraintKind.CHOICE, json.dumps(["yes"])))
    assert not grammar.accept(ord("n"))
    assert allowed(grammar) == {EOS}   # a matcher in error allows EOS alone: the request ends


def test_after_the_grammar_is_complete_eos_is_all_there_is():
    grammar = compiler().start(OutputConstraint(ConstraintKind.CHOICE, json.dumps(["ok"])))
    for token in (ord("o"), ord("k"), EOS, EOS):   # ignore_eos draws EOS again: nothing left to follow
        assert grammar.accept(token)
    assert allowed(grammar) == {EOS}


def test_rows_are_masked_each_by_its_own_grammar_and_others_left_alone():
    c = compiler()
    yes, digit = (c.start(OutputConstraint(ConstraintKind.CHOICE, json.dumps(["yes"]))),
                  c.start(OutputConstraint(ConstraintKind.REGEX, "[0-9]")))
    logits = torch.randn(3, VOCAB + 20)   # wider than the tokenizer's vocabulary: the rest is masked too
    before = logits.clone()
    mask_rows_(logits, [0, 2], [yes, digit])
    assert torch.equal(logits[1], before[1])
    assert {int(t) for t in torch.nonzero(torch.isfinite(logits[0])).flatten()} == {ord("y")}
    assert {int(t) for t in torch.nonzero(torch.isfinite(logits[2])).flatten()} == set(range(ord("0"), ord("9") + 1))
    assert torch.equal(logits[2, ord("5")], before[2, ord("5")])


def test_a_node_without_a_tokenizer_has_no_grammars():
    with pytest.raises(InvalidRequestError):
        GrammarCompiler(TokenIdsOnly(VOCAB), VOCAB).start(OutputConstraint(ConstraintKind.JSON_OBJECT, ""))


def test_a_constraint_that_does_not_compile_is_refused_where_the_matcher_is_built():
    """The server checks it first; an engine handed one directly refuses it the same way."""
    with pytest.raises(InvalidRequestError) as caught:
        compiler().start(OutputConstraint(ConstraintKind.REGEX, "[a-"))
    assert caught.value.param == "structured_outputs"
