"""The O(1)-per-step scheduler plans and finishes exactly as the plain reference does.

Random sessions (arrivals, aborts, live batch-limit changes, stop tokens, partial or
empty token maps as in a simulation) drive serving/scheduler/scheduler.py and the reference
(tests/serving/ref_scheduler.py, the scheduler before it was made lean) side by side;
every plan, every finished request and the visible state must be equal at every step.
"""

from __future__ import annotations

import random

import pytest

from serving.scheduler.plan import SchedulerConfig, SeqRequest
from serving.scheduler.scheduler import Scheduler
from tests.serving.ref_scheduler import RefScheduler


def _session(seed: int, *, tokens: str, with_ids: bool, steps: int = 300) -> int:
    rng = random.Random(seed)
    cfg = SchedulerConfig(
        max_slots=rng.choice([3, 8, 24]),
        max_batch_size=1,
        max_len=64,
        prefill_chunk=rng.choice([1, 5, 16, 64]),
    )
    cfg = SchedulerConfig(**{**cfg.__dict__, "max_batch_size": rng.randint(1, cfg.max_slots)})
    new, ref = Scheduler(cfg), RefScheduler(cfg)
    t = 0.0
    nid = 0
    checked = 0
    for _ in range(steps):
        for _ in range(rng.choice([0, 0, 1, 2, 5])):
            p = rng.randint(1, 40)
            m = rng.randint(1, 64 - p)
            ids = tuple(rng.randrange(50) for _ in range(p)) if with_ids else None
            stop = frozenset(rng.sample(range(50), 2)) if with_ids and rng.random() < 0.5 else None
            rid = f"r{nid % 40}" if rng.random() < 0.3 else f"u{nid}"  # ids get reused
            nid += 1
            r = dict(request_id=rid, prompt_len=p, max_tokens=m, arrival_s=t, prompt_ids=ids)
            if stop is not None:
                r["stop_ids"] = stop
            if ref.is_active(rid):
                assert new.is_active(rid)
                continue
            new.add(SeqRequest(**r))
            ref.add(SeqRequest(**r))
        if rng.random() < 0.05:
            b = rng.randint(1, cfg.max_slots)
            new.set_max_batch_size(b)
            ref.set_max_batch_size(b)
        p_new = new.schedule(now_s=t)
        p_ref = ref.schedule(now_s=t)
        if rng.random() < 0.5:  # read the decode entries before the update, or only after
            assert p_new.decode == p_ref.decode
        assert p_new.decode_batch == p_ref.decode_batch
        assert p_new.kv_tokens == p_ref.kv_tokens
        assert p_new.prefill == p_ref.prefill
        assert p_new.prefill_tokens == p_ref.prefill_tokens
        for rid in ref.active_ids():
            if rng.random() < 0.03:
                assert new.abort(rid) == ref.abort(rid)
        t += rng.uniform(0.001, 0.1)
        sampling = p_ref.sampling_ids()
        if tokens == "none":
            sampled: dict[str, int | None] = {}
        else:
            sampled = {rid: rng.randrange(50) for rid in sampling}
            if tokens == "partial":
                sampled = {k: v for k, v in sampled.items() if rng.random() < 0.7}
                sampled.update({"ghost": 1})  # not in the plan: ignored by both
        f_new = new.update(p_new, sampled, now_s=t)
        f_ref = ref.update(p_ref, sampled, now_s=t)
        assert p_new.decode == p_ref.decode  # the same entries after the update too
        assert p_new.sampling_ids() == sampling
        assert f_new == f_ref
        assert new.active_ids() == ref.active_ids()
        assert (new.num_running, new.num_waiting, new.kv_usage) == (
            ref.num_running,
            ref.num_waiting,
            ref.kv_usage,
        )
        for rid in new.active_ids():
            assert new.slot_of(rid) == ref.slot_of(rid)
        checked += len(f_ref) + p_ref.decode_batch
    return checked


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize(
    ("tokens", "with_ids"), [("none", False), ("all", True), ("partial", True)]
)
def test_same_plans_and_finishes_as_the_reference(seed: int, tokens: str, with_ids: bool) -> None:
    assert _session(seed, tokens=tokens, with_ids=with_ids) > 20  # it did exercise decode


def test_a_plan_is_applied_once() -> None:
    s = Scheduler(SchedulerConfig(max_slots=2, max_batch_size=2, max_len=16, prefill_chunk=8))
    s.add(SeqRequest(request_id="a", prompt_len=3, max_tokens=4, arrival_s=0.0))
    plan = s.schedule(now_s=0.0)
    s.update(plan, {}, now_s=0.1)
    with pytest.raises(ValueError, match="plan of step 0 given to update at step 1"):
        s.update(plan, {}, now_s=0.2)


@pytest.mark.parametrize("lean", [False, True])
def test_a_chunk_planned_before_an_abort_is_applied_to_no_namesake(lean: bool) -> None:
    """A prefilling request aborted between its plan and the update, and a new one queued
    under its id meanwhile: the update advances neither (the new one gets its whole prompt
    later), as in the reference; ``lean``: the simulator's schedule_totals + update_seqs."""
    cfg = SchedulerConfig(max_slots=2, max_batch_size=2, max_len=64, prefill_chunk=8)
    new, ref = Scheduler(cfg), RefScheduler(cfg)
    for s in (new, ref):
        s.add(SeqRequest(request_id="a", prompt_len=16, max_tokens=3, arrival_s=0.0))
        s.add(SeqRequest(request_id="b", prompt_len=4, max_tokens=2, arrival_s=0.0))
    got: list = []
    want: list = []
    t = 0.0
    for step in range(40):
        p_ref = ref.schedule(now_s=t)
        if lean:
            assert new.schedule_totals(t) == p_ref.totals()
        else:
            p_new = new.schedule(now_s=t)
            assert p_new.prefill == p_ref.prefill
        if step == 1:  # "a" is half prefilled; this plan has the rest of its prompt
            assert new.abort("a") and ref.abort("a")
            for s in (new, ref):
                s.add(SeqRequest(request_id="a", prompt_len=9, max_tokens=4, arrival_s=t))
        t += 0.5
        got += (
            [s.timing() for s in new.update_seqs(t)]
            if lean
            else [f.timing for f in new.update(p_new, {}, now_s=t)]
        )
        want += [f.timing for f in ref.update(p_ref, {}, now_s=t)]
        assert got == want
    assert sorted(r.generated_tokens for r in want) == [2, 4]
