"""The pure scheduler: admission, chunked prefill, live batch limit, abort, timings."""

from __future__ import annotations

import pytest

from serving.scheduler.plan import SchedulerConfig, SeqRequest, StepPlan
from serving.scheduler.scheduler import Scheduler


def make(max_slots=4, max_batch_size=4, max_len=64, prefill_chunk=16) -> Scheduler:
    return Scheduler(
        SchedulerConfig(
            max_slots=max_slots,
            max_batch_size=max_batch_size,
            max_len=max_len,
            prefill_chunk=prefill_chunk,
        )
    )


def req(rid: str, prompt_len=4, max_tokens=3, arrival_s=0.0, **kw) -> SeqRequest:
    return SeqRequest(
        request_id=rid, prompt_len=prompt_len, max_tokens=max_tokens, arrival_s=arrival_s, **kw
    )


def run_step(s: Scheduler, now: float, token: int = 7):
    plan = s.schedule(now_s=now)
    sampled = {rid: token for rid in plan.sampling_ids()}
    return plan, s.update(plan, sampled, now_s=now + 0.5)


@pytest.mark.parametrize(
    ("kw", "needle"),
    [
        ({"max_slots": 0}, "max_slots=0"),
        ({"max_batch_size": 5}, "max_batch_size=5"),
        ({"max_len": 1}, "max_len=1"),
        ({"prefill_chunk": 2.5}, "prefill_chunk=2.5"),
    ],
)
def test_config_rejects_bad_values(kw, needle) -> None:
    args = {"max_slots": 4, "max_batch_size": 4, "max_len": 64, "prefill_chunk": 16} | kw
    with pytest.raises(ValueError, match=needle):
        SchedulerConfig(**args)


@pytest.mark.parametrize(
    ("prompt_len", "max_tokens", "needle"),
    [
        (0, 3, "empty"),
        (4, -1, "max_tokens=-1"),
        (4, 0, "max_tokens=0"),
        (4, 2.0, "max_tokens=2.0"),
        (4, "3", "max_tokens='3'"),
        (4, True, "max_tokens=True"),
        (60, 5, "exceeds the context length 64"),
    ],
)
def test_add_rejects_invalid_requests(prompt_len, max_tokens, needle) -> None:
    s = make()
    with pytest.raises(ValueError, match=needle):
        s.add(req("a", prompt_len=prompt_len, max_tokens=max_tokens))
    assert not s.has_work


def test_duplicate_request_id_rejected() -> None:
    s = make()
    s.add(req("a"))
    with pytest.raises(ValueError, match="already in use"):
        s.add(req("a"))


def test_prompt_ids_length_must_match() -> None:
    with pytest.raises(ValueError, match="prompt_ids has 2 tokens"):
        make().add(req("a", prompt_len=3, prompt_ids=(1, 2)))


def test_lifecycle_prefill_then_decode_and_timings() -> None:
    s = make()
    s.add(req("a", prompt_len=4, max_tokens=3, arrival_s=1.0, prompt_ids=(1, 2, 3, 4)))
    plan, fin = run_step(s, now=2.0)
    assert plan.decode == ()
    assert [(c.start, c.length, c.last, c.token_ids) for c in plan.prefill] == [
        (0, 4, True, (1, 2, 3, 4))
    ]
    assert fin == []
    plan, fin = run_step(s, now=3.0, token=8)
    (e,) = plan.decode
    assert (e.position, e.token) == (4, 7)  # feeds the first sampled token at position 4
    assert plan.kv_tokens == 5
    plan, fin = run_step(s, now=4.0, token=9)
    assert plan.decode[0].position == 5
    (f,) = fin
    assert f.reason == "length"
    assert f.output_ids == (7, 8, 9)
    t = f.timing
    assert (t.arrival_s, t.admitted_s, t.first_token_s, t.last_token_s) == (1.0, 2.0, 2.5, 4.5)
    assert t.ttft_s == pytest.approx(1.5)
    assert t.tpot_s == pytest.approx(1.0)  # (4.5 - 2.5) / (3 - 1)
    assert t.queue_wait_s == pytest.approx(1.0)
    assert (t.prompt_tokens, t.generated_tokens) == (4, 3)
    assert not s.has_work and s.kv_usage == 0


def test_single_token_has_no_tpot() -> None:
    s = make()
    s.add(req("a", max_tokens=1))
    _, fin = run_step(s, 0.0)
    assert fin[0].timing.tpot_s is None and fin[0].timing.generated_tokens == 1


def test_stop_token_finishes_early() -> None:
    s = make()
    s.add(req("a", max_tokens=10, stop_ids=frozenset({7})))
    _, fin = run_step(s, 0.0, token=7)
    assert fin[0].reason == "stop" and fin[0].timing.generated_tokens == 1


def test_long_prompt_is_chunked_and_decode_keeps_running() -> None:
    s = make(prefill_chunk=8)
    s.add(req("short", prompt_len=2, max_tokens=10))
    run_step(s, 0.0)  # short prefilled
    s.add(req("long", prompt_len=20, max_tokens=2))
    chunks = []
    for i in range(3):
        plan, _ = run_step(s, 1.0 + i)
        assert [e.request_id for e in plan.decode] == ["short"]  # never stalled
        assert plan.prefill_tokens <= 8
        chunks += [(c.start, c.length, c.last) for c in plan.prefill]
    assert chunks == [(0, 8, False), (8, 8, False), (16, 4, True)]
    plan, _ = run_step(s, 4.0)
    assert sorted(e.request_id for e in plan.decode) == ["long", "short"]


def test_prefill_budget_shared_fifo_and_waiting_counts() -> None:
    s = make(prefill_chunk=6)
    for i in range(3):
        s.add(req(f"r{i}", prompt_len=4, arrival_s=float(i)))
    plan = s.schedule(now_s=5.0)
    assert [(c.request_id, c.length) for c in plan.prefill] == [("r0", 4), ("r1", 2)]
    assert s.num_running == 2 and s.num_waiting == 1
    s.update(plan, {"r0": 1}, now_s=5.1)
    plan = s.schedule(now_s=6.0)
    assert [(c.request_id, c.start, c.length) for c in plan.prefill] == [
        ("r1", 2, 2),
        ("r2", 0, 4),
    ]


def test_slots_bound_admission_and_are_reused() -> None:
    s = make(max_slots=2, max_batch_size=2)
    for i in range(3):
        s.add(req(f"r{i}", max_tokens=1))
    plan, fin = run_step(s, 0.0)
    assert sorted(c.slot for c in plan.prefill) == [0, 1]
    assert len(fin) == 2 and s.num_waiting == 1
    plan, fin = run_step(s, 1.0)
    assert [c.slot for c in plan.prefill] == [0]


def test_shrinking_batch_never_drops_in_flight() -> None:
    s = make(max_slots=4, max_batch_size=4, prefill_chunk=64)
    for i in range(4):
        s.add(req(f"r{i}", max_tokens=5))
    run_step(s, 0.0)
    s.set_max_batch_size(2)
    s.add(req("late", max_tokens=2))
    done = []
    for i in range(4):
        plan, fin = run_step(s, 1.0 + i)
        if i == 0:
            assert plan.decode_batch == 4  # all in-flight keep decoding
            assert s.num_waiting == 1  # the new one waits
        done += [f.request_id for f in fin]
    assert sorted(done) == ["r0", "r1", "r2", "r3"]
    for _ in range(3):
        plan, fin = run_step(s, 10.0)
        done += [f.request_id for f in fin]
    assert "late" in done
    # growing lets more in at the next schedule
    s.set_max_batch_size(3)
    assert s.max_batch_size == 3


@pytest.mark.parametrize("bad", [0, 5, 2.0, "3"])
def test_set_max_batch_size_validates(bad) -> None:
    with pytest.raises(ValueError, match="max_batch_size="):
        make().set_max_batch_size(bad)


def test_admission_respects_lowered_limit() -> None:
    s = make(max_slots=4, max_batch_size=4, prefill_chunk=64)
    s.set_max_batch_size(1)
    s.add(req("a", max_tokens=3))
    s.add(req("b", max_tokens=3))
    plan = s.schedule(now_s=0.0)
    assert [c.request_id for c in plan.prefill] == ["a"]
    assert s.num_running == 1 and s.num_waiting == 1


def test_abort_frees_slot_at_once_and_stale_plan_is_ignored() -> None:
    s = make(max_slots=1, max_batch_size=1)
    s.add(req("a", max_tokens=10))
    s.add(req("b", max_tokens=1))
    run_step(s, 0.0)
    plan = s.schedule(now_s=1.0)
    assert s.kv_usage == 1.0
    assert s.abort("a") is True
    assert s.kv_usage == 0.0 and s.slot_of("a") is None
    assert s.update(plan, {"a": 3}, now_s=1.5) == []  # stale entry ignored
    plan, fin = run_step(s, 2.0)
    assert [c.request_id for c in plan.prefill] == ["b"] and plan.prefill[0].slot == 0
    assert s.abort("a") is False


def test_abort_waiting_request() -> None:
    s = make(max_slots=1, max_batch_size=1)
    s.add(req("a"))
    s.add(req("b"))
    run_step(s, 0.0)
    assert s.abort("b") is True and s.num_waiting == 0
    assert s.abort("nope") is False


def test_simulation_without_token_ids() -> None:
    s = make(prefill_chunk=100)
    s.add(req("a", prompt_len=10, max_tokens=4))
    s.add(req("b", prompt_len=20, max_tokens=2))
    finished = []
    t = 0.0
    while s.has_work:
        plan = s.schedule(now_s=t)
        assert isinstance(plan, StepPlan)
        t += 0.01
        finished += s.update(plan, {}, now_s=t)
    assert {f.request_id: f.timing.generated_tokens for f in finished} == {"a": 4, "b": 2}
    assert all(f.output_ids == () for f in finished)


def test_deterministic() -> None:
    def trace():
        s = make(max_slots=3, max_batch_size=2, prefill_chunk=5)
        for i in range(6):
            s.add(req(f"r{i}", prompt_len=3 + i, max_tokens=1 + i % 3, arrival_s=i * 0.1))
        out = []
        t = 0.0
        while s.has_work:
            plan, fin = run_step(s, t)
            out.append((plan, [f.timing for f in fin]))
            t += 1
        return out

    assert trace() == trace()


def test_a_reused_id_is_not_finished_by_its_aborted_namesake() -> None:
    s = make(max_slots=2, max_batch_size=2, prefill_chunk=64)
    s.add(req("a", max_tokens=3))
    run_step(s, 0.0)  # "a" prefilled: it would reach max_tokens two steps later
    assert s.abort("a") is True
    s.add(req("a", max_tokens=6))
    lengths = []
    for i in range(6):
        plan, fin = run_step(s, 1.0 + i)
        lengths += [f.timing.generated_tokens for f in fin]
    assert lengths == [6]
    assert plan.decode[0].position == 4 + 4  # prompt 4, fed its 5th token in the 6th step


def test_decode_entries_read_after_the_update_are_those_it_ran() -> None:
    s = make(prefill_chunk=64)
    s.add(req("a", max_tokens=5))
    run_step(s, 0.0, token=3)
    plan = s.schedule(now_s=1.0)
    s.update(plan, {"a": 4}, now_s=1.5)
    run_step(s, 2.0, token=5)
    (e,) = plan.decode  # read two updates late: still the plan as scheduled
    assert (e.position, e.token) == (4, 3)


def test_decode_run_promises_what_stepping_does() -> None:
    def fresh() -> Scheduler:
        s = make(max_slots=4, max_batch_size=2, max_len=64, prefill_chunk=64)
        s.add(req("a", prompt_len=4, max_tokens=9))
        s.add(req("b", prompt_len=6, max_tokens=5))
        s.add(req("c", prompt_len=3, max_tokens=2))  # waits: the batch is full
        return s

    s = fresh()
    assert s.decode_run()[0] == 0  # the next plan prefills
    s.update(s.schedule(now_s=0.0), {}, now_s=1.0)
    steps, batch, kv = s.decode_run()
    # "b" reaches 5 tokens in the update of step 4; steps 1..3 finish nothing.
    assert (steps, batch) == (3, 2)
    plan = s.schedule(now_s=1.0)
    assert (plan.decode_batch, plan.kv_tokens, plan.prefill) == (2, kv, ())
    s.update(plan, {}, now_s=2.0)
    assert s.decode_run() == (2, 2, kv + 2)

    stepped = fresh()
    t = 0.0
    done_stepped = []
    while stepped.has_work:
        t += 1.0
        done_stepped += stepped.update(stepped.schedule(now_s=t - 1.0), {}, now_s=t)
    skipped = fresh()
    t = 0.0
    done_skipped = []
    while skipped.has_work:
        m = skipped.decode_run()[0]
        if m:
            t += m
            skipped.skip_decode_steps(m, now_s=t)
            continue
        t += 1.0
        done_skipped += skipped.update(skipped.schedule(now_s=t - 1.0), {}, now_s=t)
    assert done_skipped == done_stepped


def test_skip_decode_steps_refuses_more_than_promised() -> None:
    s = make(prefill_chunk=64)
    s.add(req("a", max_tokens=3))
    s.update(s.schedule(now_s=0.0), {}, now_s=1.0)
    assert s.decode_run()[0] == 1
    with pytest.raises(ValueError, match=r"steps=2: only 1..1 decode-only steps"):
        s.skip_decode_steps(2, now_s=2.0)
    e = make(prefill_chunk=64)  # an engine hands tokens: its steps are never skipped
    e.add(req("a", max_tokens=5))
    run_step(e, 0.0)
    assert e.decode_run()[0] == 0


def test_hot_path_objects_are_the_frozen_dataclasses() -> None:
    import dataclasses

    from serving.scheduler.plan import Finished, PrefillChunk, RequestTiming

    s = make(prefill_chunk=64)
    s.add(req("a", max_tokens=1, arrival_s=0.5))
    plan, (fin,) = run_step(s, 1.0)
    chunk = plan.prefill[0]
    assert chunk == PrefillChunk(
        request_id="a", slot=0, start=0, length=4, last=True, token_ids=None
    )
    assert hash(chunk) == hash(dataclasses.replace(chunk))
    timing = RequestTiming(
        request_id="a",
        arrival_s=0.5,
        admitted_s=1.0,
        first_token_s=1.5,
        last_token_s=1.5,
        prompt_tokens=4,
        generated_tokens=1,
    )
    assert fin == Finished(request_id="a", reason="length", timing=timing, output_ids=(7,))
    for obj in (chunk, fin, fin.timing):
        with pytest.raises(dataclasses.FrozenInstanceError):
            obj.request_id = "b"  # type: ignore[misc]


def _busy_session(s: Scheduler, steps: int, *, keep: bool) -> list:
    """Drive a scheduler with arrivals, finishes and an abort every few steps (ids reused)."""
    import random

    rng = random.Random(5)
    plans, seen, n = [], [], 0
    for k in range(steps):
        for _ in range(rng.choice([0, 1, 2, 3])):
            rid = f"r{n % 25}"
            n += 1
            if not s.is_active(rid):
                s.add(req(rid, prompt_len=rng.randint(1, 30), max_tokens=rng.randint(1, 30)))
        if k % 7 == 3 and s.active_ids():
            s.abort(rng.choice(s.active_ids()))
        plan = s.schedule(now_s=float(k))
        if keep:
            plans.append(plan)
        else:
            seen.append((plan.decode, plan.prefill))
        sampled = {rid: 1 for rid in plan.sampling_ids()} if k % 2 else {}
        s.update(plan, sampled, now_s=k + 0.5)
    return plans if keep else seen


def test_plans_read_long_after_they_ran_are_those_scheduled() -> None:
    # The decoding set is handed to plans as a view (a tuple rebuilt now and then, plus
    # the sequences added and removed since): reading a plan after hundreds of steps and
    # many rebuilds must give what reading it at once gave.
    def fresh() -> Scheduler:
        return make(max_slots=40, max_batch_size=40, max_len=64, prefill_chunk=24)

    at_once = _busy_session(fresh(), 400, keep=False)
    late = [(p.decode, p.prefill) for p in _busy_session(fresh(), 400, keep=True)]
    assert late == at_once
    assert max(len(d) for d, _ in at_once) >= 20  # the set grew past the rebuild margin


def test_lean_plan_counts_match_its_entries() -> None:
    s = make(max_slots=8, max_batch_size=8, prefill_chunk=10)
    for i, p in enumerate((7, 9, 3)):
        s.add(req(f"r{i}", prompt_len=p, max_tokens=5))
    for t in range(6):
        plan = s.schedule(now_s=float(t))
        totals = plan.totals()
        assert totals == (
            len(plan.decode),
            sum(e.position + 1 for e in plan.decode),
            sum(c.length for c in plan.prefill),
            len(plan.prefill),
        )
        assert (plan.decode_batch, plan.kv_tokens) == totals[:2]
        assert (plan.prefill_tokens, plan.prefill_count) == totals[2:]
        s.update(plan, {}, now_s=t + 0.5)
    by_hand = StepPlan(decode=plan.decode, prefill=plan.prefill)
    assert by_hand == plan and by_hand.totals() == plan.totals() and by_hand.step == -1
    with pytest.raises(ValueError, match="plan of step -1 given to update at step 6"):
        s.update(by_hand, {}, now_s=9.0)


def test_new_request_is_the_dataclass() -> None:
    from serving.scheduler.plan import new_request

    r = new_request("x", 5, 3, 1.25)
    assert r == SeqRequest(request_id="x", prompt_len=5, max_tokens=3, arrival_s=1.25)
    assert r.prompt_ids is None and r.stop_ids == frozenset()


def test_add_checks_int_subclasses_the_long_way() -> None:
    import numpy as np

    s = make()
    with pytest.raises(ValueError, match=r"prompt length np.int64\(4\)"):
        s.add(req("a", prompt_len=np.int64(4)))
    with pytest.raises(ValueError, match="max_tokens=True"):
        s.add(req("a", max_tokens=True))
    assert not s.has_work


@pytest.mark.parametrize(
    ("prompt_len", "max_tokens", "needle"),
    [(0, 3, "empty"), (4, 0, "max_tokens=0"), (4, 2.0, "max_tokens=2.0"), (60, 5, "exceeds")],
)
def test_add_new_checks_as_add_does(prompt_len, max_tokens, needle) -> None:
    s = make()
    with pytest.raises(ValueError, match=needle):
        s.add_new("a", prompt_len, max_tokens, 0.0)
    s.add_new("a", 4, 3, 0.0)
    with pytest.raises(ValueError, match="already in use"):
        s.add_new("a", 4, 3, 0.0)
    twin = make()
    twin.add(req("a", prompt_len=4, max_tokens=3))
    assert [run_step(s, 0.0)[1] for _ in range(4)] == [run_step(twin, 0.0)[1] for _ in range(4)]


def test_the_simulators_step_is_schedule_and_update_without_the_plan() -> None:
    """schedule_totals + update_seqs plan and apply exactly what schedule + update do."""
    import random

    from serving.scheduler.plan import SchedulerConfig
    from serving.scheduler.scheduler import Scheduler

    cfg = SchedulerConfig(max_slots=6, max_batch_size=4, max_len=64, prefill_chunk=16)
    a, b = Scheduler(cfg), Scheduler(cfg)
    rng = random.Random(5)
    t = 0.0
    for i in range(300):
        if rng.random() < 0.5:
            plen, mt = rng.randint(1, 40), rng.randint(1, 20)
            a.add_new(str(i), plen, mt, t)
            b.add_new(str(i), plen, mt, t)
        if i % 37 == 5 and a.active_ids():
            rid = rng.choice(a.active_ids())
            assert a.abort(rid) == b.abort(rid)
        if not a.has_work:
            t += 0.5
            continue
        plan = a.schedule(t)
        assert b.schedule_totals(t) == plan.totals()
        t += 0.01
        want = a.update(plan, {}, t)
        got = b.update_seqs(t)
        assert [s.finished("length") for s in got] == want
        assert [s.timing() for s in got] == [f.timing for f in want]
    with pytest.raises(ValueError, match="schedule the step first"):
        b.update_seqs(t)


@pytest.mark.parametrize("with_tokens", [False, True])
def test_requests_start_decoding_in_admission_order(with_tokens: bool) -> None:
    """The lists of requests by the step of their last token are in admission order
    without sorting (_pop_due relies on it): FIFO prefill starts them in that order."""
    import random

    rng = random.Random(11 + with_tokens)
    for chunk in (1, 7, 16, 64):
        s = make(max_slots=8, max_batch_size=6, max_len=128, prefill_chunk=chunk)
        t = 0.0
        for i in range(400):
            for _ in range(rng.randint(0, 3)):
                s.add(
                    req(
                        f"r{i}.{rng.random()}",
                        prompt_len=rng.randint(1, 60),
                        max_tokens=rng.randint(1, 40),
                        arrival_s=t,
                        stop_ids=frozenset({3}),
                    )
                )
            if i % 23 == 7 and s.active_ids():
                s.abort(rng.choice(s.active_ids()))
            if not s.has_work:
                continue
            plan = s.schedule(t)
            t += 0.01
            sampled = {r: rng.randint(0, 40) for r in plan.sampling_ids()} if with_tokens else {}
            s.update(plan, sampled, t)
            for bucket in s._ends.values():
                orders = [q.order for q in bucket]
                assert orders == sorted(orders)
