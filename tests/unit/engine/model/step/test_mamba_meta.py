"""A Mamba group's step as the kernel walks it: each sequence's rows, whether it resumes from its slot, and the saves
ordered by sequence then row; saves outside the step and states that are not float32 are refused."""

import pytest
import torch

from hybridpd.engine.kv_cache.spec import MambaSpec
from hybridpd.engine.model.step.forward_batch import ForwardBatch, SeqEntry
from hybridpd.engine.model.step.mamba_meta import mamba_group_meta

SPEC = MambaSpec(block_size=4, conv_state_shape=(3, 8), ssm_state_shape=(2, 4, 4),
                 dtypes=(torch.float32, torch.float32))


def batch(*seqs: SeqEntry) -> ForwardBatch:
    total = sum(s.num_new for s in seqs)
    return ForwardBatch(input_ids=torch.zeros(total, dtype=torch.long), positions=torch.zeros(total, dtype=torch.long),
                        seqs=seqs, logits_indices=torch.zeros(len(seqs), dtype=torch.long))


def entry(num_computed, num_new, slot, saves=()):
    """Group 0 is attention (no saves), group 1 the Mamba group under test."""
    return SeqEntry(num_computed=num_computed, num_new=num_new, block_tables=((1, 2), (slot,)),
                    mamba_saves=((), tuple(saves)))


CASES = {
    "decode rows": (
        [entry(9, 1, 5), entry(3, 1, 2)],
        dict(starts=[0, 1], lengths=[1, 1], resumed=[1, 1], slots=[5, 2], save_seqs=[], save_after=[], save_slots=[]),
    ),
    "a fresh prefill beside a decode, saves taken in row order": (
        [entry(0, 10, 7, saves=[(8, 11), (4, 12)]), entry(5, 1, 3)],
        dict(starts=[0, 10], lengths=[10, 1], resumed=[0, 1], slots=[7, 3], save_seqs=[0, 0], save_after=[4, 8],
             save_slots=[12, 11]),
    ),
    "a resumed chunk saving at its end": (
        [entry(3, 1, 1), entry(8, 8, 4, saves=[(16, 9)])],
        dict(starts=[0, 1], lengths=[1, 8], resumed=[1, 1], slots=[1, 4], save_seqs=[1], save_after=[8],
             save_slots=[9]),
    ),
}


@pytest.mark.parametrize("case", list(CASES))
def test_rows_as_the_kernel_walks_them(case):
    seqs, expected = CASES[case]
    rows = mamba_group_meta(batch(*seqs), 1, SPEC)
    got = {name: getattr(rows, name).tolist() for name in expected}
    assert got == expected
    assert all(getattr(rows, name).dtype.name == "int64" for name in expected)


@pytest.mark.parametrize("num_tokens", [4, 13])
def test_a_save_outside_the_step_is_refused(num_tokens):
    with pytest.raises(ValueError, match="outside this step"):
        mamba_group_meta(batch(entry(4, 8, 1, saves=[(num_tokens, 2)])), 1, SPEC)


def test_states_that_are_not_float32_are_refused():
    spec = MambaSpec(block_size=4, conv_state_shape=(3, 8), ssm_state_shape=(2, 4, 4),
                     dtypes=(torch.bfloat16, torch.float32))
    with pytest.raises(ValueError, match="float32"):
        mamba_group_meta(batch(entry(0, 2, 1)), 1, spec)
