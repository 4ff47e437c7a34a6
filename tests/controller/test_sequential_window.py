"""A sequential window: it stops once its verdict is decided, confirmed by the server's view,
and runs to its request budget when undecided (a real HTTP load against a fake server)."""

from __future__ import annotations

import asyncio

from controller.targets import RequestShape, WindowPlan, measure_window
from controller.windows import ClientWindow
from metrics.observation import Observation, Slo, Verdict
from metrics.sequential import requests_to_met
from search.space import Knobs
from serving.sim.workload import LengthDist
from tests.controller.test_loadgen import FakeOpenAI, serving

SHAPE = RequestShape(prompt_tokens=LengthDist(mean=4), output_tokens=LengthDist(mean=3))


class _Blind:
    """A server view without request counts: it never confirms a verdict."""

    def begin(self) -> str:
        return "tok"

    def end(self, token, *, start_s, end_s) -> Observation:
        return Observation(start_s=start_s, end_s=end_s, completed=1, slo_met=1, source="blind")


def _measure(slo: Slo, plan: WindowPlan, reader, knobs: Knobs):
    fake = FakeOpenAI(first_delay_s=0.001, token_delay_s=0.0005)

    async def go():
        async with serving(fake) as url:
            return await measure_window(
                url=url.removesuffix("/v1/completions"),
                knobs=knobs,
                slo=slo,
                plan=plan,
                shape=SHAPE,
                reader=reader,
            )

    return asyncio.run(go())


def _plan(**kw) -> WindowPlan:
    base = dict(
        warmup_s=0.1, window_s=0.1, max_window_s=60.0, poll_s=0.02, look_s=0.05, sequential=True
    )
    return WindowPlan(**{**base, **kw})


def test_a_clear_violation_ends_the_window_after_a_few_dozen_requests() -> None:
    slo = Slo(ttft_p99_s=1e-6, tpot_p99_s=10.0)  # every request is over the TTFT SLO
    m = _measure(
        slo,
        _plan(budget_requests=2000),
        ClientWindow(slo=slo),
        Knobs(max_batch_size=2, max_concurrency=4),
    )
    obs = m.observation
    assert obs.ttft_verdict is not None and obs.ttft_verdict.verdict is Verdict.VIOLATED
    assert 20 <= obs.completed < 200  # decided long before its budget


def test_a_clean_pass_ends_once_met_is_decided() -> None:
    slo = Slo(ttft_p99_s=10.0, tpot_p99_s=10.0)  # no request comes near the SLO
    m = _measure(
        slo,
        _plan(budget_requests=5000),
        ClientWindow(slo=slo),
        Knobs(max_batch_size=2, max_concurrency=4),
    )
    need = requests_to_met(0, 0)
    assert need is not None
    assert need <= m.observation.completed < 2 * need  # stopped soon after MET, not at 5000


def test_an_unconfirmed_verdict_runs_to_the_request_budget() -> None:
    slo = Slo(ttft_p99_s=1e-6, tpot_p99_s=10.0)  # the client sees a violation ...
    m = _measure(
        slo, _plan(budget_requests=150), _Blind(), Knobs(max_batch_size=2, max_concurrency=4)
    )
    assert m.observation.source == "blind"  # ... the server's view never decides
    assert m.client is not None and m.client.completed >= 150  # so the budget ends it


def test_a_whole_window_ignores_early_verdicts() -> None:
    slo = Slo(ttft_p99_s=1e-6, tpot_p99_s=10.0)
    plan = _plan(sequential=False, min_requests=400, budget_requests=20)
    m = _measure(slo, plan, ClientWindow(slo=slo), Knobs(max_batch_size=2, max_concurrency=4))
    assert m.observation.completed >= 400
