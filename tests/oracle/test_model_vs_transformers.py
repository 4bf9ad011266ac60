"""GraniteLM over the paged cache vs transformers' GraniteMoeHybridForCausalLM on the same checkpoint.

The reference runs one full forward of a sequence; ours computes the same tokens in any split (one step,
uneven chunks, decode steps, batched with other sequences, resumed from a saved Mamba state). Logits must agree
within 1e-4 at every position. The tiny preset's windows are 5 and 11 and its Mamba chunk is 8, so the
sequences below cross both windows and many chunk boundaries, with chunks that start mid-chunk.
"""

from __future__ import annotations

import pytest
import torch

from hybridpd.engine.kv_cache.spec import AttentionSpec
from hybridpd.engine.model.loader import load_model
from hybridpd.presets.checkpoints import write_checkpoint
from tests.oracle.paged_runner import PagedRunner
from tests.oracle.reference import load_reference, reference_logits

TOL = 1e-4
BLOCK_SIZE = 4


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    model_dir = write_checkpoint("tiny", tmp_path_factory.mktemp("tiny"))
    _, model = load_model(model_dir, torch.float32)
    return model, load_reference(model_dir)


def tokens(seed: int, n: int) -> list[int]:
    return torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def close(ours: torch.Tensor, ref: torch.Tensor) -> None:
    assert ours.shape == ref.shape
    diff = (ours - ref).abs().max().item()
    assert diff < TOL, f"max |logit difference| {diff}"


@pytest.mark.parametrize("chunks", [
    [48],                      # the whole prompt in one step
    [5, 3, 13, 1, 9, 17],      # uneven chunks, most not aligned to the chunk size (8), one single-token chunk
    [8, 16, 24],               # chunk-aligned
    [1, 1, 1, 1, 44],          # a prompt that starts with single tokens
])
def test_chunked_prefill(tiny, chunks):
    model, ref = tiny
    ids = tokens(1, sum(chunks))
    expected = reference_logits(ref, ids)
    runner = PagedRunner(model, BLOCK_SIZE, max_seqs=1, max_len=64)
    at = 0
    for n in chunks:
        close(runner.step([(0, ids[at : at + n])])[0], expected[at : at + n])
        at += n


def test_prefill_then_decode(tiny):
    model, ref = tiny
    ids = tokens(2, 40)
    expected = reference_logits(ref, ids)
    runner = PagedRunner(model, BLOCK_SIZE, max_seqs=1, max_len=64)
    close(runner.step([(0, ids[:27])])[0], expected[:27])
    for pos in range(27, 40):
        close(runner.step([(0, [ids[pos]])])[0], expected[pos : pos + 1])


def test_batched_sequences(tiny):
    """Mixed batches (prefill chunks next to decode rows), then decode-only batches of different lengths."""
    model, ref = tiny
    seqs = {0: tokens(3, 30), 1: tokens(4, 23), 2: tokens(5, 26)}
    expected = {s: reference_logits(ref, ids) for s, ids in seqs.items()}
    runner = PagedRunner(model, BLOCK_SIZE, max_seqs=3, max_len=64)
    done = {0: 0, 1: 0, 2: 0}

    def run(plan: list[tuple[int, int]]) -> None:
        work = [(s, seqs[s][done[s] : done[s] + n]) for s, n in plan]
        for (s, n), logits in zip(plan, runner.step(work)):
            close(logits, expected[s][done[s] : done[s] + n])
            done[s] += n

    run([(0, 20), (1, 14)])              # two prefills
    run([(0, 1), (1, 1), (2, 13)])       # two decodes and a prefill
    run([(2, 7), (0, 1)])                # a prefill chunk crossing a chunk boundary, then a decode
    for _ in range(5):
        run([(1, 1), (2, 1), (0, 1)])    # decode-only
    run([(1, 3)])
    assert done == {0: 27, 1: 23, 2: 25}


@pytest.mark.parametrize("saved_at, prompt_steps", [
    (16, [21]),        # a chunk boundary inside one prefill step
    (16, [5, 20]),     # ... inside a step that starts mid-chunk (boundaries at absolute multiples of 8)
    (32, [3, 9, 25]),  # ... two chunks into a step that starts mid-chunk
    (24, [10, 14]),    # the boundary is the end of the second (unaligned) step
    (21, [21]),        # the step's end, not a chunk boundary
    (30, [29, 1]),     # saved by a decode step
])
def test_mamba_saved_state_resumes(tiny, saved_at, prompt_steps):
    """Sequence 0 saves its state after `saved_at` tokens; sequence 1 shares that prefix, starts from a copy
    of the saved state (and of the prefix's KV blocks), and computes only its own continuation."""
    model, ref = tiny
    prefix = tokens(6, saved_at)
    first = prefix + tokens(7, sum(prompt_steps) - saved_at)
    second = prefix + tokens(8, 17)
    runner = PagedRunner(model, BLOCK_SIZE, max_seqs=2, max_len=64)
    spare = runner.spare_slot(0)
    at = 0
    for n in prompt_steps:
        saves = {0: [(saved_at, spare)]} if at < saved_at <= at + n else {}
        runner.step([(0, first[at : at + n])], saves=saves)
        at += n

    for g, group in enumerate(runner.groups):
        if isinstance(group.spec, AttentionSpec):
            src, dst = runner.tables(0)[g], runner.tables(1)[g]
            for logical in range(-(-saved_at // BLOCK_SIZE)):
                runner.kv.copy_block(g, int(src[logical]), int(dst[logical]))
        else:
            runner.kv.copy_block(g, spare, int(runner.tables(1)[g][0]))

    expected = reference_logits(ref, second)
    logits = runner.step([(1, second[saved_at:])], start_at={1: saved_at})[0]
    close(logits, expected[saved_at:])


def test_state_slot_garbage_is_ignored_for_a_new_sequence(tiny):
    """A slot reused by a new sequence (num_computed == 0) must start from zeros, not the old owner's state."""
    model, ref = tiny
    runner = PagedRunner(model, BLOCK_SIZE, max_seqs=1, max_len=64)
    runner.step([(0, tokens(9, 30))])
    ids = tokens(10, 19)
    close(runner.step([(0, ids)], start_at={0: 0})[0], reference_logits(ref, ids))


def test_small_preset_one_step(tmp_path):
    """The default preset: windows 64 and 160, chunk 32; a 200-token prompt then a batched decode step."""
    torch.set_num_threads(1)
    model_dir = write_checkpoint("small", tmp_path)
    _, model = load_model(model_dir, torch.float32)
    ref = load_reference(model_dir)
    ids = tokens(11, 201)
    expected = reference_logits(ref, ids)
    runner = PagedRunner(model, 16, max_seqs=1, max_len=256)
    close(runner.step([(0, ids[:200])])[0], expected[:200])
    close(runner.step([(0, ids[200:])])[0], expected[200:])


def _copy_prefix(runner: PagedRunner, src_seq: int, dst_seq: int, spare: int, num_tokens: int) -> None:
    """Give dst_seq src_seq's first num_tokens: its attention blocks, and the Mamba state saved in `spare`."""
    for g, group in enumerate(runner.groups):
        if isinstance(group.spec, AttentionSpec):
            src, dst = runner.tables(src_seq)[g], runner.tables(dst_seq)[g]
            for logical in range(-(-num_tokens // BLOCK_SIZE)):
                runner.kv.copy_block(g, src[logical], dst[logical])
        else:
            runner.kv.copy_block(g, spare, runner.tables(dst_seq)[g][0])


def test_batched_prefills_save_and_resume(tiny):
    """Several Mamba prefills in one step (one batched scan): different lengths and chunk offsets, each saving
    a state at a chunk boundary; then two sequences resumed from those saves prefill next to a fresh one."""
    model, ref = tiny
    seqs = {0: tokens(12, 24), 1: tokens(13, 22), 2: tokens(14, 25)}
    seqs[3] = seqs[1][:16] + tokens(15, 9)   # resumes from sequence 1's state at 16
    seqs[4] = seqs[0][:16] + tokens(16, 5)   # resumes from sequence 0's state at 16
    seqs[5] = tokens(17, 11)                 # fresh, in a slot a previous sequence used
    expected = {s: reference_logits(ref, ids) for s, ids in seqs.items()}
    runner = PagedRunner(model, BLOCK_SIZE, max_seqs=6, max_len=32)
    done = dict.fromkeys(seqs, 0)

    def run(plan: list[tuple[int, int]], saves: dict[int, list[tuple[int, int]]], start_at=None) -> None:
        done.update(start_at or {})
        work = [(s, seqs[s][done[s] : done[s] + n]) for s, n in plan]
        for (s, n), logits in zip(plan, runner.step(work, saves=saves, start_at=start_at)):
            close(logits, expected[s][done[s] : done[s] + n])
            done[s] += n

    run([(5, 9)], {})                                                       # dirties slot 6 (sequence 5's)
    run([(0, 13), (1, 21), (2, 5)], {1: [(16, runner.spare_slot(0))]}, start_at={5: 0})
    run([(0, 11), (1, 1), (2, 20)], {0: [(16, runner.spare_slot(1))]})
    _copy_prefix(runner, 1, 3, runner.spare_slot(0), 16)
    _copy_prefix(runner, 0, 4, runner.spare_slot(1), 16)
    run([(3, 9), (4, 5), (5, 11)], {}, start_at={3: 16, 4: 16, 5: 0})
    assert done == {0: 24, 1: 22, 2: 25, 3: 25, 4: 21, 5: 11}
