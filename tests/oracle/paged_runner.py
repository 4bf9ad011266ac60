"""A minimal test driver of a `PagedCausalLM` over a real `KVCacheStorage`: fixed block tables, no scheduler.

Sequence k owns attention blocks `1 + k * blocks_per_seq + i` (block 0 is the null block) and Mamba slot
`1 + k`; spare Mamba slots after the sequences' ones are free for `mamba_saves`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from hybridpd.engine.kv_cache.spec import MambaSpec, group_layers
from hybridpd.engine.kv_cache.storage import KVCacheStorage
from hybridpd.engine.model.step.forward_batch import ForwardBatch, SeqEntry
from hybridpd.engine.model.paged_lm import PagedCausalLM


@dataclass
class PagedRunner:
    model: PagedCausalLM
    block_size: int
    max_seqs: int
    max_len: int
    spare_slots: int = 4
    num_computed: dict[int, int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        specs = self.model.kv_cache_specs(self.block_size, self.model.config.mamba_chunk_size)
        self.groups = group_layers(specs)
        self.blocks_per_seq = -(-self.max_len // self.block_size)
        counts = tuple(
            1 + self.max_seqs + self.spare_slots if isinstance(g.spec, MambaSpec)
            else 1 + self.max_seqs * self.blocks_per_seq
            for g in self.groups
        )
        self.kv = KVCacheStorage(self.groups, counts)

    def spare_slot(self, i: int) -> int:
        return 1 + self.max_seqs + i

    def mamba_group_ids(self) -> list[int]:
        return [g for g, group in enumerate(self.groups) if isinstance(group.spec, MambaSpec)]

    def tables(self, seq: int) -> tuple[tuple[int, ...], ...]:
        first = 1 + seq * self.blocks_per_seq
        return tuple(
            (1 + seq,) if isinstance(g.spec, MambaSpec) else tuple(range(first, first + self.blocks_per_seq))
            for g in self.groups
        )

    def step(
        self, work: list[tuple[int, list[int]]], saves: dict[int, list[tuple[int, int]]] | None = None,
        start_at: dict[int, int] | None = None, all_logits: bool = True,
    ) -> list[torch.Tensor]:
        """work: (seq, new tokens) in batch order. saves: seq -> [(num_tokens, slot)] for every Mamba group.
        start_at: seq -> num_computed override (e.g. after copying a saved state into its slot).
        Returns per sequence the logits of every new row (all_logits) or of its last row."""
        saves = saves or {}
        for seq, at in (start_at or {}).items():
            self.num_computed[seq] = at
        seqs, ids, positions, wanted = [], [], [], []
        row = 0
        for seq, tokens in work:
            done = self.num_computed.get(seq, 0)
            mamba = set(self.mamba_group_ids())
            seqs.append(SeqEntry(
                num_computed=done, num_new=len(tokens), block_tables=self.tables(seq),
                mamba_saves=tuple(tuple(saves.get(seq, ())) if g in mamba else () for g in range(len(self.groups))),
            ))
            ids.extend(tokens)
            positions.extend(range(done, done + len(tokens)))
            wanted.append(list(range(row, row + len(tokens))) if all_logits else [row + len(tokens) - 1])
            row += len(tokens)
            self.num_computed[seq] = done + len(tokens)
        flat = [r for rows in wanted for r in rows]
        batch = ForwardBatch(
            input_ids=torch.tensor(ids), positions=torch.tensor(positions), seqs=tuple(seqs),
            logits_indices=torch.tensor(flat),
        )
        logits = self.model(batch, self.kv)
        out, at = [], 0
        for rows in wanted:
            out.append(logits[at : at + len(rows)])
            at += len(rows)
        return out
