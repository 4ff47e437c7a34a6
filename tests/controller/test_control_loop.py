"""The production control loop (controller/control/loop.py) against scripted windows and a
fake actuator: faults hold, changes are applied once, state survives a SIGKILL, one
controller per deployment."""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from controller.backends.actuator import ActuatorError, ApplyCost, ForeignChange
from controller.control.decide import State
from controller.control.loop import ControlFailed, LoopConfig, run_control
from controller.control.policy import Policy
from controller.control.store import Lease, LeaseHeld, load_state, save_state
from metrics import names
from metrics.exporter import ControllerExporter
from metrics.observation import Observation, Slo, SloVerdict, Verdict
from search.space import Knobs

SLO = Slo(ttft_p99_s=1.0, tpot_p99_s=0.1)
POLICY = Policy(slo=SLO, batch_max=64, stabilization_s=120.0)
K16 = Knobs(max_batch_size=16, max_concurrency=16)
ROOT = Path(__file__).resolve().parents[2]


def window(start: float, end: float, *, tpot: float = 0.5, overloaded: int = 0) -> Observation:
    def v(share: float, bound: float) -> SloVerdict:
        return SloVerdict(
            verdict=Verdict.MET if share <= 1 else Verdict.VIOLATED,
            threshold_s=bound,
            estimate_s=share * bound,
            samples=500,
            confidence=0.95,
        )

    return Observation(
        start_s=start,
        end_s=end,
        completed=500,
        slo_met=500,
        rejected=overloaded,
        overloaded=overloaded,
        ttft_verdict=v(0.4, 1.0),
        tpot_verdict=v(tpot, 0.1),
    )


class Script:
    """A reader whose n-th window is ``plan[n]``: a TPOT share of the SLO, a (share,
    refused for want of room) pair, or an exception to raise (Prometheus down)."""

    def __init__(self, plan: list) -> None:
        self.plan = plan
        self.n = 0

    def begin(self):
        return None

    def end(self, token, *, start_s: float, end_s: float) -> Observation:
        step = self.plan[min(self.n, len(self.plan) - 1)]
        self.n += 1
        if isinstance(step, Exception):
            raise step
        tpot, overloaded = step if isinstance(step, tuple) else (step, 0)
        return window(start_s, end_s, tpot=tpot, overloaded=overloaded)


class FakeActuator:
    name = "fake"

    def __init__(self, knobs: Knobs, fleets: list | None = None) -> None:
        self.knobs = knobs
        self.applied: list[Knobs] = []
        self.fleets = fleets or []
        self.reads = 0
        self.gone = False
        self.foreign = ""  # a derived setting changed by someone else, until the next apply

    def current(self) -> Knobs:
        if self.gone:
            raise ActuatorError("application 'llm' not found")
        if self.foreign:
            raise ForeignChange(self.foreign)
        return self.knobs

    def apply(self, knobs: Knobs, *, batch_cap: int | None = None) -> ApplyCost:
        self.applied.append(knobs)
        changed = knobs != self.knobs or bool(self.foreign)
        self.knobs, self.foreign = knobs, ""
        return ApplyCost(changed=changed)

    def fleet(self):
        self.reads += 1
        if self.fleets:
            return self.fleets[min(self.reads - 1, len(self.fleets) - 1)]
        return (("r1", 1, "v1"),)

    def scaling(self):
        return None

    def effects(self):
        raise NotImplementedError

    def describe(self):
        return {"actuator": "fake"}


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t

    def sleep(self, s: float) -> None:
        self.t += s


def run(tmp_path: Path, plan: list, act: FakeActuator, *, ticks: int, **kw) -> tuple[State, list]:
    clock = Clock()
    policy, exporter = kw.pop("policy", POLICY), kw.pop("exporter", None)
    lease = kw.pop("cluster_lease", None)
    state = run_control(
        reader=Script(plan),
        actuator=act,
        policy=policy,
        state_path=tmp_path / "state.json",
        audit_path=tmp_path / "audit.jsonl",
        config=LoopConfig(interval_s=60.0, max_ticks=ticks, **kw),
        exporter=exporter,
        cluster_lease=lease,
        clock=clock,
        sleep=clock.sleep,
    )
    rows = [json.loads(x) for x in (tmp_path / "audit.jsonl").read_text().splitlines()]
    return state, rows


class ScriptedLease:
    """A cluster lease whose n-th renewal answers ``plan[n]``: "" (renewed), a reason (the
    API server away: this tick must not act) or an exception (lost)."""

    def __init__(self, plan: list) -> None:
        self.plan, self.n, self.entered = plan, 0, False

    def __enter__(self):
        self.entered = True
        return self

    def __exit__(self, *exc: object) -> None:
        self.entered = False

    def renew(self) -> str:
        step = self.plan[min(self.n, len(self.plan) - 1)]
        self.n += 1
        if isinstance(step, Exception):
            raise step
        return step


def test_a_tick_whose_lease_was_not_renewed_acts_on_nothing(tmp_path) -> None:
    act = FakeActuator(K16)
    lease = ScriptedLease(["", "the Lease could not be renewed (503); not acting this tick", ""])
    _, rows = run(tmp_path, [1.5, 1.5, 1.5], act, ticks=3, cluster_lease=lease)
    assert [r["action"] for r in rows] == ["tighten", "hold", "tighten"]
    assert rows[1]["outcome"] == "inconclusive" and "not acting this tick" in rows[1]["reason"]
    assert len(act.applied) == 2 and not lease.entered  # released at the end


def test_a_lost_lease_stops_the_controller(tmp_path) -> None:
    from controller.control.kube_lease import LeaseLost

    act = FakeActuator(K16)
    lease = ScriptedLease(["", LeaseLost("Lease serving/x is now held by 'pod-b'")])
    with pytest.raises(ControlFailed, match="held by 'pod-b'"):
        run(tmp_path, [1.5, 1.5], act, ticks=2, cluster_lease=lease)
    assert len(act.applied) == 1 and not lease.entered


def test_prometheus_down_holds_never_loosens_and_recovers(tmp_path) -> None:
    down = ConnectionError("Prometheus at http://127.0.0.1:9090 refused the connection")
    act = FakeActuator(K16)
    # calm queueing, then a minute of Prometheus down, then calm again, then trouble
    plan = [(0.5, 10)] * 2 + [down] * 3 + [(0.5, 10)] * 2 + [1.5]
    # 180 s of calm queueing would loosen: 120 s before the outage and 120 s after it do not
    policy = Policy(slo=SLO, batch_max=64, stabilization_s=180.0)
    state, rows = run(tmp_path, plan, act, ticks=8, policy=policy)
    assert [r["outcome"] for r in rows[2:5]] == ["inconclusive"] * 3
    assert all(r["action"] == "hold" and "could not be read" in r["reason"] for r in rows[2:5])
    # the calm before the outage does not count toward loosening after it
    assert [r["action"] for r in rows[:7]] == ["hold"] * 7
    assert rows[7]["action"] == "tighten" and act.applied == [
        Knobs(max_batch_size=12, max_concurrency=12)
    ]
    assert state.knobs == act.knobs


def test_a_replica_restart_in_the_window_is_no_decision(tmp_path) -> None:
    fleets = [(("r1", 1, "v1"),), (("r1", 2, "v1"),), (("r1", 2, "v1"),)]
    act = FakeActuator(K16, fleets)
    _, rows = run(tmp_path, [1.5, 1.5], act, ticks=2)
    assert rows[0]["outcome"] == "inconclusive" and "replicas changed" in rows[0]["reason"]
    assert rows[1]["action"] == "tighten"
    assert len(act.applied) == 1


def test_dry_run_recommends_and_applies_nothing(tmp_path) -> None:
    act = FakeActuator(K16)
    state, rows = run(tmp_path, [1.5, 1.5], act, ticks=2, dry_run=True)
    assert act.applied == [] and state.knobs == K16
    assert [r["action"] for r in rows] == ["tighten", "tighten"]
    assert all(r["dry_run"] and not r["applied"] for r in rows)


def test_someone_elses_change_pauses_without_fighting(tmp_path) -> None:
    act = FakeActuator(K16)
    save_state(State(knobs=Knobs(max_batch_size=24, max_concurrency=24)), tmp_path / "state.json")
    _, rows = run(tmp_path, [1.5, 1.5], act, ticks=2)
    assert [r["action"] for r in rows] == ["pause", "pause"] and act.applied == []
    assert "changed by someone else" in rows[0]["reason"]


def test_a_derived_setting_changed_alone_pauses_until_acked_then_slotune_writes_its_own(
    tmp_path,
) -> None:
    from controller.control.loop import ack_path

    act = FakeActuator(K16)
    act.foreign = "llm/Server: Serve's max_ongoing_requests is 50 where ... make it 96"
    save_state(State(knobs=K16), tmp_path / "state.json")
    _, rows = run(tmp_path, [1.5, 1.5], act, ticks=2)
    assert [r["action"] for r in rows] == ["pause", "pause"] and act.applied == []
    assert "is 50 where" in rows[0]["reason"] and "changed by someone else" in rows[0]["reason"]
    fresh = tmp_path / "fresh"  # no saved state: nothing of slotune's to go back to
    fresh.mkdir()
    with pytest.raises(ControlFailed, match="is 50 where .* set it back"):
        run(fresh, [1.5], act, ticks=1)
    ack_path(tmp_path / "state.json").touch()  # slotune control --ack
    (tmp_path / "audit.jsonl").unlink()
    state, rows = run(tmp_path, [1.5, 1.5], act, ticks=2)
    # the ack writes slotune's own config for its knobs once and holds that tick; then as ever
    assert act.applied[0] == K16 and act.foreign == ""
    assert [r["action"] for r in rows] == ["hold", "tighten"]
    assert "written again" in rows[0]["reason"] and state.knobs.max_batch_size < 16


def test_the_deployment_deleted_under_it_is_a_clear_failure(tmp_path) -> None:
    act = FakeActuator(K16)
    act.gone = True
    save_state(State(knobs=K16), tmp_path / "state.json")
    with pytest.raises(ControlFailed, match="cannot be read: application 'llm' not found"):
        run(tmp_path, [0.5], act, ticks=1)


def test_the_knobs_level_is_saved_with_the_state(tmp_path) -> None:
    state, rows = run(tmp_path, [0.97], FakeActuator(K16), ticks=1)
    assert rows[0]["action"] == "hold" and len(state.level) == 1
    assert state.level[0][2] == pytest.approx(0.97)
    assert load_state(tmp_path / "state.json") == state
    # a window's answer length, unknown, is saved as null and read back as NaN; a file
    # written before the level kept it reads NaN too (taken as the same load)
    st = State(knobs=K16, level=((60.0, 0.5, 0.9, math.nan), (120.0, 0.5, 0.92, 180.0)))
    save_state(st, tmp_path / "state.json")
    d = json.loads((tmp_path / "state.json").read_text())
    assert d["level"] == [[60.0, 0.5, 0.9, None], [120.0, 0.5, 0.92, 180.0]]
    back = load_state(tmp_path / "state.json").level
    assert math.isnan(back[0][3]) and back[0][:3] == (60.0, 0.5, 0.9) and back[1] == st.level[1]
    d["level"] = [[60.0, 0.5, 0.9]]
    (tmp_path / "state.json").write_text(json.dumps(d))
    (old,) = load_state(tmp_path / "state.json").level
    assert old[:3] == (60.0, 0.5, 0.9) and math.isnan(old[3])


def test_a_raise_on_trial_and_its_ceiling_are_saved_with_the_state(tmp_path) -> None:
    k20 = Knobs(max_batch_size=20, max_concurrency=20)
    for st in (State(knobs=k20, raised_from=K16), State(knobs=K16, ceiling=(20, 1234.5))):
        save_state(st, tmp_path / "state.json")
        assert load_state(tmp_path / "state.json") == st


def test_every_tick_is_audited_saved_and_exported(tmp_path) -> None:
    act = FakeActuator(K16)
    exp = ControllerExporter()
    state, rows = run(tmp_path, [0.5, 1.5], act, ticks=2, exporter=exp)
    assert load_state(tmp_path / "state.json") == state
    assert rows[1]["from"] == K16.as_dict() and rows[1]["to"] == state.knobs.as_dict()
    assert rows[1]["observation"]["tpot"]["verdict"] == "violated"
    assert rows[1]["observation"]["completed"] == 500
    text = exp.text()
    assert f'{names.CONTROLLER_DECISIONS_TOTAL}{{action="tighten",outcome="violated"}} 1.0' in text
    assert f'{names.CONTROLLER_KNOB}{{knob="max_batch_size"}} 12.0' in text
    # the band it steered by: as configured, the windows' spread not yet known
    assert f'{names.CONTROLLER_TPOT_BAND}{{edge="tighten"}} 0.95' in text
    assert f"{names.CONTROLLER_TPOT_SPREAD} NaN" in text


def test_a_second_controller_is_refused_while_the_first_holds_the_lease(tmp_path) -> None:
    path = tmp_path / "state.json"
    with Lease(path), pytest.raises(LeaseHeld, match=f"pid {os.getpid()}"):
        Lease(path).acquire()
    with Lease(path):  # released: taken again
        pass


CHILD = textwrap.dedent(
    """
    import sys, time
    from pathlib import Path
    sys.path.insert(0, sys.argv[2])
    sys.path.insert(0, sys.argv[3])
    from test_control_loop import FakeActuator, Script, POLICY, K16
    from controller.control.loop import LoopConfig, run_control
    tmp = Path(sys.argv[1])
    act = FakeActuator(K16)
    act.knobs = __import__("controller.control.store", fromlist=["x"]).load_state(
        tmp / "state.json").knobs if (tmp / "state.json").exists() else K16
    run_control(reader=Script([1.5] * 3 + [0.8]), actuator=act, policy=POLICY,
                state_path=tmp / "state.json", audit_path=tmp / "audit.jsonl",
                config=LoopConfig(interval_s=0.05), sleep=time.sleep)
    """
)


def test_sigkilled_and_restarted_it_resumes_on_the_same_knobs(tmp_path) -> None:
    script = tmp_path / "child.py"
    script.write_text(CHILD)
    args = [sys.executable, str(script), str(tmp_path), str(ROOT), str(Path(__file__).parent)]
    child = subprocess.Popen(args, cwd=ROOT)
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:  # three tightenings, then it holds in the band
            s = load_state(tmp_path / "state.json")
            if s is not None and s.ticks >= 5:
                break
            time.sleep(0.1)
        else:
            pytest.fail("the controller did not tick")
        # a second controller is refused while it runs
        with pytest.raises(LeaseHeld):
            Lease(tmp_path / "state.json").acquire()
        os.kill(child.pid, signal.SIGKILL)
        child.wait(timeout=30)
    finally:
        if child.poll() is None:
            child.kill()
    killed = load_state(tmp_path / "state.json")
    assert killed is not None and killed.knobs == Knobs(max_batch_size=7, max_concurrency=7)
    # restarted (the lease died with it): the same knobs, nothing applied at start
    act = FakeActuator(killed.knobs)
    state, _ = run(tmp_path, [0.8], act, ticks=1)
    assert act.applied == [] and state.knobs == killed.knobs
    assert state.ticks == killed.ticks + 1
