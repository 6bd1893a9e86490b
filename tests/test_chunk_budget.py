"""S11 chunk budget from a target ITL (engine/chunk_budget.py), driven through the real Scheduler and
BlockManager with a fake clock: every step "takes" the time a known cost function gives for the batch the
scheduler planned. That function is written here from the scheduled (sequence, tokens) pairs, independently of
the budget's own features, and has the shape real steps have (a fixed cost, a cost per token and per decode,
attention over the keys each query sees). The budget only ever sees the measured seconds."""
import numpy as np
import pytest

from pyengine import tuning
from pyengine.engine.block_manager import BlockManager
from pyengine.engine.chunk_budget import ChunkBudget, StepCostModel, StepShape
from pyengine.engine.scheduler import Scheduler
from pyengine.engine.sequence import Sequence


def step_seconds(out, speed: float = 1.0) -> float:
    """20 ms a step + 1 ms a token + 0.4 ms a decode + 30 ns a (query, key) pair of attention."""
    t = 0.020
    for seq, n in out.scheduled:
        start = seq.num_computed_tokens
        decode = seq.num_tokens - start == 1
        keys = sum(range(start + 1, start + n + 1))
        t += 0.001 * n + (0.0004 if decode else 0.0) + 30e-9 * keys
    return t * speed


class Run:
    """8 decodes running; at step `arrive` a prompt of `n_long` tokens arrives. Records every step."""

    def __init__(self, target_itl_ms=None, n_long=2000, decoders=8, arrive=20, max_num_batched_tokens=4096):
        self.bm = BlockManager(2048, 16)
        self.budget = ChunkBudget(target_itl_ms)
        self.sch = Scheduler(self.bm, max_num_seqs=16, max_num_batched_tokens=max_num_batched_tokens,
                             max_model_len=8192, chunk_budget=self.budget)
        self.decs = [Sequence(i, f"d{i}", 0, [1 + i] * 8, max_tokens=5000) for i in range(decoders)]
        for s in self.decs:
            self.sch.add(s)
        self.long = Sequence(99, "long", 0, [5] * n_long, max_tokens=2)
        self.arrive = arrive
        self.steps = []          # dict per step: seconds, chunk, remaining before, decodes scheduled, target

    def run(self, speed=lambda step: 1.0, max_steps=2000):
        for k in range(max_steps):
            if k == self.arrive:
                self.sch.add(self.long)
            out = self.sch.schedule()
            seconds = step_seconds(out, speed(k))
            remaining = self.long.num_tokens - self.long.num_computed_tokens
            chunk = sum(n for s, n in out.scheduled if s is self.long)
            decodes = sum(1 for s, n in out.scheduled if s in self.decs and n == 1)
            self.steps.append({"k": k, "seconds": seconds, "chunk": chunk, "remaining": remaining,
                               "decodes": decodes, "target": self.budget.last_target})
            self.sch.observe_step(out, seconds)
            self.sch.on_step_done(out)
            for s, _ in out.scheduled:
                if s.num_computed_tokens == s.num_tokens:
                    s.append_token(3)
            self.bm.check_invariants(self.sch.running)
            if self.long.num_output_tokens:
                return self
        raise AssertionError("the prompt never finished")

    def prefill_steps(self):
        return [s for s in self.steps if s["chunk"]]


def test_chosen_budgets_meet_a_fixed_target():
    r = Run(target_itl_ms=150).run()
    pre = r.prefill_steps()
    assert all(s["decodes"] == 8 for s in r.steps[1:])                    # decodes are always in the step
    # the ramp: the first chunk is the minimum, each later one at most CHUNK_GROWTH x the largest before
    assert pre[0]["chunk"] == tuning.CHUNK_MIN_TOKENS
    for i in range(1, len(pre)):
        assert pre[i]["chunk"] <= tuning.CHUNK_GROWTH * max(s["chunk"] for s in pre[:i])
    settled = pre[4:]
    assert len(settled) >= 10
    for s in settled:
        assert s["seconds"] <= 0.150 * 1.01, s                            # the target holds
        if s["chunk"] < s["remaining"]:
            assert s["seconds"] >= 0.150 * 0.9, s                          # and the chunk is not needlessly small
    # attention makes late chunks dearer: the budget shrinks as the prompt's context grows
    assert settled[-2]["chunk"] < settled[0]["chunk"]


def test_budget_adapts_when_the_host_slows_down_and_recovers():
    slow_from, fast_from = 30, 60
    r = Run(target_itl_ms=150, n_long=4000).run(speed=lambda k: 2.0 if slow_from <= k < fast_from else 1.0)
    by_k = {s["k"]: s for s in r.prefill_steps()}
    before = [by_k[k]["chunk"] for k in range(slow_from - 4, slow_from)]
    slow = [by_k[k] for k in range(slow_from + 12, fast_from)]
    assert all(s["seconds"] <= 0.150 * 1.02 for s in slow), slow          # within the target again at 2x cost
    assert max(s["chunk"] for s in slow) < 0.6 * min(before)              # with much smaller chunks
    after = [by_k[k] for k in range(fast_from + 12, fast_from + 20) if k in by_k]
    assert after and all(s["seconds"] <= 0.150 * 1.02 for s in after)
    assert min(s["chunk"] for s in after) > 1.5 * max(s["chunk"] for s in slow)   # and grow back


def test_a_target_below_the_decodes_cost_still_moves_the_prompt():
    # the decodes alone take ~31 ms: a 10 ms target can never be met, the prompt still gets its minimum chunk
    r = Run(target_itl_ms=10, n_long=160).run()
    pre = r.prefill_steps()
    assert [s["chunk"] for s in pre] == [tuning.CHUNK_MIN_TOKENS] * 10
    assert all(s["decodes"] == 8 for s in r.steps[1:])


def test_derived_target_is_a_multiple_of_the_decodes_own_cost():
    r = Run(target_itl_ms=None).run()
    decode_alone = r.steps[r.arrive - 1]["seconds"]
    pre = r.prefill_steps()
    # until the spread is measured (ITL_SPREAD_MIN_STEPS steps past the ramp): the prior multiplier; then, on
    # this noiseless clock (spread 0), the goal's, for good
    def which(m):
        for name, value in (("prior", tuning.TARGET_ITL_DECODE_MULT), ("goal", tuning.ITL_GOAL_MULT)):
            if m == pytest.approx(value, rel=0.02):
                return name
        return m
    mults = [which(s["target"] / decode_alone) for s in pre[4:]]
    prior, goal = "prior", "goal"
    switch = mults.index(goal)
    assert set(mults[:switch]) <= {prior} and set(mults[switch:]) == {goal}, mults
    assert tuning.ITL_SPREAD_MIN_STEPS - 4 <= switch <= tuning.ITL_SPREAD_MIN_STEPS + 4 < len(mults) // 2
    for s in pre[4:]:
        assert s["seconds"] <= s["target"] * 1.01
    assert r.budget.stats()["target_itl_multiplier"] == pytest.approx(tuning.ITL_GOAL_MULT, rel=1e-3)
    # far fewer steps than a fixed budget of "decodes + 9" tokens would take
    assert len(pre) < 2000 / 9 / 3


@pytest.mark.parametrize("noise", [0.04, 0.12])
def test_derived_target_keeps_the_measured_spread_as_margin(noise):
    """Every step runs (1 + u) x its cost, u uniform in [-noise, noise] (a host whose step times scatter): the
    multiplier settles at ITL_GOAL_MULT / (1 + the spread the budget measured), the spread near the noise's 95th
    percentile, and the ITL p99 over the prompt stays within 3x the decodes' median step; a noisier host gets a
    smaller multiplier, so more steps."""
    u = np.random.default_rng(1).uniform(-noise, noise, 4000)
    r = Run(target_itl_ms=None, n_long=4000).run(speed=lambda k: 1 + u[k])
    stats = r.budget.stats()
    assert stats["step_cost_spread"] == pytest.approx(0.9 * noise, abs=0.35 * noise)
    assert stats["target_itl_multiplier"] == pytest.approx(tuning.ITL_GOAL_MULT / (1 + stats["step_cost_spread"]))
    calm = np.median([s["seconds"] for s in r.steps[1:r.arrive]])
    busy = [s["seconds"] for s in r.prefill_steps()]
    assert np.percentile(busy, 99) <= 3.0 * calm
    quiet = Run(target_itl_ms=None, n_long=4000).run()
    assert len(busy) > len(quiet.prefill_steps())


def test_without_decodes_the_prompt_takes_the_whole_token_budget():
    r = Run(target_itl_ms=50, n_long=3000, decoders=0, arrive=0, max_num_batched_tokens=1024).run()
    assert [s["chunk"] for s in r.prefill_steps()] == [1024, 1024, 952]


def test_cost_model_fits_known_costs_despite_outliers():
    rng = np.random.default_rng(0)
    theta = np.array([0.02, 0.001, 0.0004, 0.03])
    model = StepCostModel()
    shapes = []
    for i in range(60):
        sh = StepShape()
        for _ in range(int(rng.integers(1, 9))):
            sh.add_decode(int(rng.integers(10, 3000)), 1)
        if i % 2:
            sh.add_chunk(int(rng.integers(0, 3000)), int(rng.integers(16, 400)))
        seconds = sh.x @ theta
        if i % 10 == 3:
            seconds *= 8                                        # a step the OS descheduled
        model.observe(sh, float(seconds))
        shapes.append(sh)
    for sh in shapes[-20:]:
        assert model.predict(sh.x) == pytest.approx(sh.x @ theta, rel=0.03)


@pytest.mark.parametrize("bad", [-1, float("nan"), float("inf"), "fast", True])
def test_bad_targets_are_rejected(bad):
    from engine_fakes import FakeRunner
    from pyengine.engine.llm_engine import LLMEngine
    with pytest.raises(ValueError, match="target_itl_ms"):
        LLMEngine(runner=FakeRunner(), target_itl_ms=bad)


def test_zero_turns_the_budget_off_and_unchunked_engines_have_none():
    from engine_fakes import FakeRunner
    from pyengine.engine.llm_engine import LLMEngine
    assert LLMEngine(runner=FakeRunner(), target_itl_ms=0).scheduler.chunk_budget is None
    assert LLMEngine(runner=FakeRunner(), enable_chunked_prefill=False).scheduler.chunk_budget is None
    assert LLMEngine(runner=FakeRunner(), target_itl_ms=80).scheduler.chunk_budget.target_itl == 0.08
    from pyengine.llm import LLM                                 # the offline API passes it through
    assert LLM(runner=FakeRunner(), target_itl_ms=80).llm_engine.stats()["target_itl_ms"] == 80.0


def test_two_prompts_in_one_step_share_one_target():
    """A second prompt admitted in the same step gets only what the first left; the derived target rests on
    the decodes alone, not on the chunks already planned."""
    r = Run(target_itl_ms=None, n_long=3000)
    second = Sequence(100, "second", 0, [6] * 3000, max_tokens=2)      # arrives just after r.long (id 99)
    got_second = 0
    for k in range(60):
        if k == r.arrive:
            r.sch.add(r.long)
            r.sch.add(second)
        out = r.sch.schedule()
        seconds = step_seconds(out)
        sched = {s.seq_id: n for s, n in out.scheduled}
        if k > r.arrive + 6:
            assert seconds <= r.budget.last_target * 1.01
            assert r.budget.last_target == pytest.approx(r.budget.multiplier() * 0.0312, rel=0.05)
            assert sched.get(99, 0) > 0                     # the first prompt always progresses
            got_second += sched.get(100, 0)
        r.sch.observe_step(out, seconds)
        r.sch.on_step_done(out)
        for s, _ in out.scheduled:
            if s.num_computed_tokens == s.num_tokens:
                s.append_token(3)
    assert got_second < 16 * 50                             # it only gets what the first leaves over
