"""The engine's side of structured outputs: a matcher per constrained request that follows its output tokens
through the constraint's grammar (llguidance), and the mask it puts on that request's logits before a token is
drawn, as vLLM applies its grammar bitmask before the sampler (so logprobs are of the masked logits, as there).

Once the grammar is complete the mask allows EOS alone; a request that ignores EOS goes on drawing it. The first token
of a request prefilled on another node was drawn there under the same constraint: the decode node's matcher takes it
before the request's first step here.
"""

from __future__ import annotations

from dataclasses import dataclass

import llguidance
import numpy as np
import torch

from hybridpd.engine.output_constraint import OutputConstraint
from hybridpd.engine.tokenizer import BYTE_VOCAB, ByteTokenizer, HFTokenizer, Tokenizer
from hybridpd.errors import InvalidRequestError


class _ByteVocabulary:
    """A byte tokenizer as llguidance's TokenizerWrapper reads one: each id's bytes (a special id as 0xFF + its name,
    llguidance's mark of a special token) and an encoder of bytes."""

    def __init__(self, tokenizer: ByteTokenizer) -> None:
        self.eos_token_id = tokenizer.eos_token_id
        self.bos_token_id = tokenizer.bos_token_id
        self.tokens = [bytes([i]) for i in range(BYTE_VOCAB)] + [
            b"\xff<%d>" % i for i in range(BYTE_VOCAB, tokenizer.vocab_size)]
        self.special_token_ids = list(range(BYTE_VOCAB, tokenizer.vocab_size))

    def __call__(self, text: bytes) -> list[int]:
        return list(text)


def grammar_vocabulary(tokenizer: Tokenizer, vocab_size: int) -> llguidance.LLTokenizer:
    """The model's vocabulary as llguidance walks it (built once per engine: ~1 s for a 100k vocabulary)."""
    eos = tokenizer.eos_token_id
    if isinstance(tokenizer, HFTokenizer):
        return llguidance.LLTokenizer(tokenizer.backend_json(), n_vocab=vocab_size, eos_token=eos)
    if isinstance(tokenizer, ByteTokenizer):
        return llguidance.LLTokenizer(llguidance.TokenizerWrapper(_ByteVocabulary(tokenizer)), n_vocab=vocab_size)
    raise InvalidRequestError("structured outputs need the model's tokenizer (this node runs without one)",
                              "structured_outputs")


@dataclass(eq=False)
class Grammar:
    """One request's place in its constraint's grammar."""

    matcher: llguidance.LLMatcher
    vocab_words: int   # 32-bit words of a mask row

    def accept(self, token: int) -> bool:
        """The request's next output token; False when the grammar does not allow it. A token the mask allowed
        always moves the matcher on; after the grammar is complete (EOS drawn, or drawn again with ignore_eos) there
        is nothing left to follow."""
        if self.matcher.is_stopped():
            return True
        return self.matcher.consume_token(token)

    def fill_mask(self, row: np.ndarray) -> None:
        """The tokens allowed next, one bit each, into `row` (int32 [vocab_words])."""
        self.matcher.unsafe_compute_mask_ptr(row.ctypes.data, row.nbytes)


class GrammarCompiler:
    """Matchers for an engine's constrained requests; the vocabulary is walked at the first one."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int) -> None:
        self._tokenizer = tokenizer
        self._vocab_size = vocab_size
        self._vocabulary: llguidance.LLTokenizer | None = None

    def start(self, constraint: OutputConstraint) -> Grammar:
        if self._vocabulary is None:
            self._vocabulary = grammar_vocabulary(self._tokenizer, self._vocab_size)
        matcher = llguidance.LLMatcher(self._vocabulary, constraint.grammar(), log_level=0)
        if matcher.is_error():
            raise InvalidRequestError(f"{constraint.kind.value}: {matcher.get_error()}", constraint.field)
        return Grammar(matcher, -(-self._vocabulary.vocab_size // 32))


def mask_rows_(logits: torch.Tensor, rows: list[int], grammars: list[Grammar]) -> None:
    """Rows `rows` of `logits` [R, vocab] (float32, contiguous) with every token its grammar does not allow next set
    to -inf, in place."""
    words = grammars[0].vocab_words
    bits = np.empty((len(rows), words), dtype=np.int32)
    for i, grammar in enumerate(grammars):
        grammar.fill_mask(bits[i])
    allowed = np.unpackbits(bits.view(np.uint8), axis=1, bitorder="little")   # [rows, 32 * words], 1 = allowed
    vocab = logits.shape[1]
    blocked = torch.ones((len(rows), vocab), dtype=torch.bool)
    width = min(vocab, allowed.shape[1])
    blocked[:, :width] = torch.from_numpy(allowed[:, :width] == 0)
    index = torch.tensor(rows, dtype=torch.int64)
    logits[index] = logits[index].masked_fill(blocked, float("-inf"))
