"""The engine's scratch blocks: reused within an engine's cycles, fresh memory outside them,
one buffer per purpose, and in use during an engine's step."""

import torch

from smc_sd.engine import scratch
from smc_sd.engine.batch import BatchEngine, Request
from smc_sd.engine.cycle_locals import lending
from smc_sd.engine.scratch import Scratch
from smc_sd.program import Schedule
from smc_sd.programs import smc_speculative
from tests.toy_programs import PROMPT, target_and_draft


def test_a_purpose_reuses_its_buffer_and_grows_to_the_largest_shape():
    like = torch.zeros(1)
    own = Scratch()
    with lending(scratch=own):
        first = scratch.block("a", like, (4, 8))
        smaller = scratch.block("a", like, (2, 8))
        assert smaller.data_ptr() == first.data_ptr()
        other = scratch.block("b", like, (4, 8))
        assert other.data_ptr() != first.data_ptr()
        larger = scratch.block("a", like, (16, 8))
        assert larger.shape == (16, 8) and larger.is_contiguous()
        assert scratch.block("a", like, (3, 5)).data_ptr() == larger.data_ptr()
        # another dtype is another buffer
        assert scratch.block("a", torch.zeros(1, dtype=torch.float64), (4, 8)).dtype == torch.float64


def test_outside_an_engine_cycle_every_block_is_fresh():
    like = torch.zeros(3, 5)
    first = scratch.block("a", like)
    second = scratch.block("a", like)
    assert first.shape == (3, 5) and first.data_ptr() != second.data_ptr()
    own = Scratch()
    with lending(scratch=own):
        inside = scratch.block("a", like)
    assert scratch.block("a", like).data_ptr() != inside.data_ptr()


def test_nested_lending_restores_the_outer_scratch():
    like = torch.zeros(2)
    outer, inner = Scratch(), Scratch()
    with lending(scratch=outer):
        a = scratch.block("x", like)
        with lending(scratch=inner):
            assert scratch.block("x", like).data_ptr() != a.data_ptr()
        assert scratch.block("x", like).data_ptr() == a.data_ptr()


def test_an_engine_step_draws_into_its_scratch():
    # the engine's draws and its importance block go through its scratch (else each cycle
    # faults its [R, V] blocks in afresh, as outside an engine)
    target, draft = target_and_draft()
    program = smc_speculative.program(target, draft, draft_len=3)
    engine = BatchEngine(target, draft, max_running=2)
    for seed in range(2):
        engine.submit(Request(PROMPT, program, Schedule(2, max_tokens=8), seed))
    engine.step()
    engine.step()
    assert {"draw_weights", "block_logp"} <= {key[0] for key in engine._scratch._buffers}
