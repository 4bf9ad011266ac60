"""Which Mamba states a request saves for the prefix cache: a few chosen boundaries, not every interval.

A saved state costs a whole Mamba slot (on published shapes, tens of times the attention KV of its interval), so
a request keeps (with K = the last interval boundary inside its prompt, in intervals):
- K and K-1: the prompt's end, where a repeat of the prompt (hits stop at N-1) or a continuation of the
  conversation hits;
- the boundary at the prefix it shares with what the cache already held (the full-attention hit at admission):
  demand has shown that prefix is shared, and the next prompt that shares it hits there;
- fewer than 8 evenly spaced checkpoints along the prompt (every 2^(bits(K) - 3) intervals), so that a prefix shared
  for the first time hits close to where it ends (within an eighth to a quarter of the prompt);
- while generating, boundaries at 1, 2, 4, 8, ... intervals past K (a continuation hits near the end of the
  answer without a save per interval).
Everything else is skipped; saved states then compete for the Mamba pool's slots in the same LRU as all blocks.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class MambaRetention:
    num_prompt_tokens: int
    shared_tokens: int      # the prefix full attention found cached at admission (0: none)
    interval: int
    every: bool = False     # MambaRetentionPolicy.EVERY: keep every boundary (the densest policy)

    def keeps(self, boundary: int) -> bool:
        """Should the state after `boundary` intervals (boundary * interval tokens) be saved?"""
        if self.every:
            return True
        last = self.num_prompt_tokens // self.interval
        if boundary > last:
            past = boundary - last
            return past & (past - 1) == 0
        if boundary in (last, last - 1) or boundary == self.shared_tokens // self.interval > 0:
            return True
        step = 1 << max(0, last.bit_length() - 3)
        return boundary % step == 0
