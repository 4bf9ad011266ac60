"""Detokenizer: what is released step by step, stop strings across token boundaries, held-back text, UTF-8."""

from __future__ import annotations

from collections.abc import Sequence

import pytest

from hybridpd.engine.detokenizer import Detokenizer
from hybridpd.engine.tokenizer import ByteTokenizer

from .engine_harness import finished_text


class PieceTokenizer:
    """Each id decodes to a fixed multi-character piece (like a BPE vocabulary)."""

    eos_token_id = None
    decodes_text = True

    def __init__(self, pieces: Sequence[str]) -> None:
        self.pieces = list(pieces)
        self.vocab_size = len(pieces)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        raise NotImplementedError

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return "".join(self.pieces[i] for i in ids)

    def apply_chat_template(self, messages) -> str:
        raise NotImplementedError


BYTES = ByteTokenizer(258)


def drive(detok: Detokenizer, ids: Sequence[int], *, finish: bool = True) -> tuple[list[str], str | None]:
    """Step token by token like the engine does (final on the last step), stopping at a stop string."""
    pieces: list[str] = []
    for i in range(len(ids)):
        new, stop = detok.step(list(ids[: i + 1]), final=finish and i == len(ids) - 1)
        pieces.append(new)
        if stop is not None:
            return pieces, stop
    return pieces, None


@pytest.mark.parametrize("text, stop, expected_text, expected_stop", [
    ("hello world", (), "hello world", None),
    ("hello world", ("wor",), "hello ", "wor"),
    ("hello world", ("o",), "hell", "o"),
    ("hello world", ("hello",), "", "hello"),
    ("hello world", ("xyz",), "hello world", None),
    ("hello world", ("ld",), "hello wor", "ld"),
    ("hello world", ("world!",), "hello world", None),        # a prefix of a stop at the end is released at the end
    ("hello world", ("xyz", "lo w"), "hel", "lo w"),
    ("aaab", ("aab",), "a", "aab"),                            # overlapping prefixes
    ("abababc", ("ababc",), "ab", "ababc"),
])
def test_bytes_one_token_at_a_time(text, stop, expected_text, expected_stop):
    detok = Detokenizer(BYTES, stop)
    pieces, matched = drive(detok, BYTES.encode(text))
    assert "".join(pieces) == expected_text
    assert matched == expected_stop


PIECES = ["hel", "lo", " wo", "rld", "!", "a", "bc", "abc", "\n\n", "x"]


@pytest.mark.parametrize("ids, stop, expected_text, expected_stop", [
    ([0, 1, 2, 3], (" world",), "hello", " world"),            # the stop spans three tokens
    ([0, 1, 2, 3], ("lo w",), "hel", "lo w"),                  # starts mid-token, ends mid-token
    ([0, 1, 2, 3, 4], ("d!",), "hello worl", "d!"),
    ([7], ("bc", "a"), "", "a"),                               # one token holds two stops: the earlier one wins
    ([5, 6], ("bc", "ab"), "", "ab"),
    ([9, 7], ("c", "b"), "xa", "b"),
    ([0, 8, 1], ("\n\n",), "hel", "\n\n"),
    ([0, 1], ("hello",), "", "hello"),
    ([0, 1, 2], ("lo", "hello wo"), "hel", "lo"),
])
def test_multi_character_tokens(ids, stop, expected_text, expected_stop):
    detok = Detokenizer(PieceTokenizer(PIECES), stop)
    pieces, matched = drive(detok, ids)
    assert "".join(pieces) == expected_text
    assert matched == expected_stop


@pytest.mark.parametrize("text, stop, steps", [
    # (released text after each non-final step): the last len(longest stop) - 1 characters wait
    ("abcdef", ("xyz",), ["", "", "a", "b", "c"]),
    ("abcdef", ("xy", "uvwxyz"), ["", "", "", "", ""]),
    ("abcdef", ("q",), ["a", "b", "c", "d", "e"]),
    ("abcdef", (), ["a", "b", "c", "d", "e"]),
])
def test_held_back_text_waits_until_it_is_decided(text, stop, steps):
    detok = Detokenizer(BYTES, stop)
    ids = BYTES.encode(text)
    released = [detok.step(ids[: i + 1], final=False)[0] for i in range(len(ids) - 1)]
    assert released == steps
    last, matched = detok.step(ids, final=True)
    assert "".join(released) + last == text and matched is None


@pytest.mark.parametrize("text", ["é", "€uro", "a😀b", "日本語", "x\u00a0y"])
def test_incomplete_utf8_is_never_released(text):
    detok = Detokenizer(BYTES, ())
    ids = BYTES.encode(text)
    pieces, _ = drive(detok, ids)
    assert "".join(pieces) == text
    assert all("\ufffd" not in piece for piece in pieces)


@pytest.mark.parametrize("ids, expected", [
    (list("ok".encode()) + [0xE2, 0x82], "ok"),      # cut inside a character: those bytes write nothing (vLLM's)
    (list("ok".encode()) + [0xFF], "ok"),            # never valid, at the end: nothing either
    (list("ok".encode()) + [0xFF, 0x41], "ok\ufffdA"),  # never valid, followed: the replacement character
    (list("ok".encode()) + [256, 257], "ok"),        # special ids decode to nothing
])
def test_final_flush_releases_everything_but_an_unfinished_character(ids, expected):
    detok = Detokenizer(BYTES, ("zz",))
    pieces, matched = drive(detok, ids)
    assert "".join(pieces) == expected and matched is None


def test_stop_made_of_multibyte_characters():
    detok = Detokenizer(BYTES, ("€",))
    pieces, matched = drive(detok, BYTES.encode("5 € each"))
    assert "".join(pieces) == "5 " and matched == "€"


def test_release_never_repeats_or_goes_back():
    detok = Detokenizer(BYTES, ("END",))
    ids = BYTES.encode("one two three END four")
    total = ""
    for i in range(len(ids)):
        new, matched = detok.step(ids[: i + 1], final=False)
        total += new
        assert "one two three ".startswith(total)
        if matched is not None:
            break
    assert total == "one two three " and matched == "END"


@pytest.mark.parametrize("seed", range(4))
def test_incremental_text_equals_decoding_everything_with_the_preset_tokenizer(seed):
    """The default preset's tokenizer.json (byte-level BPE, as transformers writes it): random ids, released token
    by token, add up to exactly what one decode of all of them gives, but for last ids that end inside a character
    (they write nothing, as in vLLM): one decode of the longest prefix that does not."""
    import json
    import random

    from hybridpd.presets.checkpoints import default_model_dir
    from hybridpd.engine.tokenizer import load_tokenizer

    model_dir = default_model_dir()
    vocab = json.loads((model_dir / "config.json").read_text())["vocab_size"]
    tokenizer = load_tokenizer(model_dir, vocab)
    rng = random.Random(seed)
    for _ in range(25):
        ids = [rng.randrange(vocab) for _ in range(rng.randrange(1, 60))]
        pieces, stop = drive(Detokenizer(tokenizer, ()), ids)
        assert stop is None and "".join(pieces) == finished_text(tokenizer, ids)


def test_a_decoder_that_rewrites_its_context_falls_back_to_decoding_everything():
    """A decoder whose text for earlier ids changes once more follow ("b" then "c" reads "Bc", as a clean-up rule
    might): the detokenizer's text is again what one decode of all ids gives, and later text is released from it
    (what was released before cannot be taken back, as with any streaming detokenizer)."""

    class Rewriting(PieceTokenizer):
        def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
            return super().decode(ids).replace("bc", "Bc")

    tok = Rewriting(["a", "b", "c"])
    detok = Detokenizer(tok, ())
    pieces, _ = drive(detok, [0, 1, 2, 0])
    assert detok.text == tok.decode([0, 1, 2, 0]) == "aBca"
    assert pieces == ["a", "b", "c", "a"]


@pytest.mark.parametrize("ids, stop, min_tokens, expected_text, expected_stop", [
    # min_tokens 2: "lo w" ends in the third token, past it: matched as without min_tokens
    ([0, 1, 2, 3], ("lo w",), 2, "hel", "lo w"),
    # min_tokens 3: "lo w" was complete before the output was past min_tokens: never matched (as vLLM, a match must
    # take in new text), the text runs on
    ([0, 1, 2, 3], ("lo w",), 3, "hello world", None),
    # ... while a stop that ends in new text is matched even when it starts in the old
    ([0, 1, 2, 3], ("o wor",), 3, "hell", "o wor"),
    ([0, 1, 2, 3], ("hello",), 1, "", "hello"),         # "hel" came before, "lo" completes it after: matched
    ([0, 1, 2, 3], ("hel",), 1, "hello world", None),    # the whole stop came before
    ([0, 1, 2, 3], ("hel",), 0, "", "hel"),
])
def test_stop_strings_wait_for_min_tokens(ids, stop, min_tokens, expected_text, expected_stop):
    detok = Detokenizer(PieceTokenizer(PIECES), stop)
    pieces, matched = [], None
    for i in range(len(ids)):
        new, matched = detok.step(list(ids[: i + 1]), final=i == len(ids) - 1, match_stops=i + 1 > min_tokens)
        pieces.append(new)
        if matched is not None:
            break
    assert "".join(pieces) == expected_text
    assert matched == expected_stop


@pytest.mark.parametrize("ids, stop", [
    ([0, 1, 2, 3], (" world",)), ([0, 1, 2, 3], ("lo w",)), ([7], ("bc", "a")), ([9, 7], ("c", "b")),
    ([0, 8, 1], ("\n\n",)), ([0, 1, 2], ("lo", "hello wo")), ([0, 1, 2, 3, 4], ("zz",)),
])
def test_a_stop_string_kept_in_the_output_ends_it_where_it_ends(ids, stop):
    """`include_stop_str_in_output`: the same stop at the same place, its text kept, nothing held back meanwhile."""
    plain, plain_stop = drive(Detokenizer(PieceTokenizer(PIECES), stop), ids)
    kept = Detokenizer(PieceTokenizer(PIECES), stop, include_stop=True)
    pieces, kept_stop = drive(kept, ids)
    assert kept_stop == plain_stop and "".join(pieces) == "".join(plain) + (plain_stop or "")
    whole = PieceTokenizer(PIECES).decode(ids)
    for i in range(1, len(ids)):   # every step releases all it has up to the stop
        fresh = Detokenizer(PieceTokenizer(PIECES), stop, include_stop=True)
        released = "".join(fresh.step(ids[:j + 1], final=False)[0] for j in range(i))
        assert whole.startswith(released) and (fresh.text == released)


def test_special_tokens_written_out_when_not_skipped():
    class Specials:
        def decode(self, ids, skip_special_tokens=True):
            return "".join("<s>" if i == 0 else chr(96 + i) for i in ids if i or not skip_special_tokens)

    pieces, _ = drive(Detokenizer(Specials(), (), skip_special_tokens=False), [1, 0, 2])
    assert "".join(pieces) == "a<s>b"
    pieces, _ = drive(Detokenizer(Specials(), ()), [1, 0, 2])
    assert "".join(pieces) == "ab"
