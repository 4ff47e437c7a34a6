"""A replica whose user_config sets no admission limit admits its deployment's
``max_ongoing_requests``, and follows it when the ``serve`` actuator changes it in place.

Without that key the ``serve`` actuator (controller/backends/serve.py) moves the
deployment's ``max_ongoing_requests`` (with it, the key: docs/serving.md, "Which limit the
replica admits"). The admission object is tested directly first; then slotune's app on the session
cluster, deployed declaratively without ``user_config.max_ongoing_requests`` and tuned
through Serve's REST API: the same replica (same pid) admits the larger limit.
"""

from __future__ import annotations

import asyncio
import threading
import time
import uuid

import httpx
import pytest

from serving.app.admission import Admission, Overloaded
from serving.app.config import LiveConfig

# ---- the admission object and the config -------------------------------------------------


def test_without_its_own_limit_admission_reads_the_default_at_each_decision() -> None:
    async def main() -> None:
        deployment = {"limit": 1}
        adm = Admission(queue=None, default_limit=lambda: deployment["limit"])
        assert adm.effective_limit == 1
        first = await adm.acquire()
        waiter = asyncio.create_task(adm.acquire())
        await asyncio.sleep(0)
        assert (adm.running, adm.waiting) == (1, 1)
        deployment["limit"] = 3  # Serve changed it: nobody calls the admission object
        third = await adm.acquire()  # the next decision sees it, and lets the waiter in first
        second = await waiter
        assert (adm.running, adm.waiting, adm.effective_limit) == (3, 0, 3)
        adm.set_limits(limit=1, queue=0)  # a user_config limit takes precedence ...
        with pytest.raises(Overloaded, match="limit of 1 requests"):
            await adm.acquire()
        adm.set_limits(limit=None, queue=None)  # ... and, unset again, the default is back
        assert adm.effective_limit == 3
        for t in (first, second, third):
            t.release()
        assert adm.running == 0

    asyncio.run(main())


def test_a_replica_queue_needs_the_replicas_own_limit() -> None:
    with pytest.raises(ValueError, match="max_queued_requests=4 without max_ongoing_requests"):
        LiveConfig(max_batch_size=2, max_queued_requests=4)
    assert LiveConfig(max_batch_size=2, max_ongoing_requests=2, max_queued_requests=4)
    assert LiveConfig(max_batch_size=2).max_ongoing_requests is None


# ---- the live app, tuned through Serve's REST API ----------------------------------------

APP = "admission-follows"
OLD, NEW = 2, 4
HOLD = {"max_tokens": 320, "temperature": 0, "stream": True}


@pytest.fixture(scope="module")
def deployed(ray_cluster):
    """slotune's app as a hand-written declarative config would have it for the serve
    actuator: the admission limit only at the deployment, none in the user_config."""
    from serving.app import ray_private
    from serving.app.config import ServerArgs
    from serving.app.deploy import app_config, delete_app
    from serving.app.replicas import wait_applied

    version = uuid.uuid4().hex[:12]
    cfg = app_config(
        name=APP,
        route_prefix=f"/{APP}",
        args=ServerArgs(model="small", max_slots=4),
        live=LiveConfig(max_batch_size=2, version=version),
        max_queued_requests=-1,
    )
    (dep,) = cfg["deployments"]
    del dep["user_config"]["max_ongoing_requests"]
    assert "max_queued_requests" not in dep["user_config"]
    dep["max_ongoing_requests"] = OLD
    client = ray_private.serve_client(start=True)
    apps = ray_private.declarative_app_configs(client)
    apps[APP] = cfg
    ray_private.deploy_apps(client, list(apps.values()))
    try:
        wait_applied(client, APP, version, 1, timeout_s=180)
        yield ray_cluster
    finally:
        delete_app(APP)


def _stats(base: str) -> dict:
    r = httpx.get(base + "/stats", timeout=30, trust_env=False)
    r.raise_for_status()
    return r.json()


def _wait_stats(base: str, what: str, ok, timeout_s: float = 120) -> dict:
    deadline = time.monotonic() + timeout_s
    st: dict = {}
    while time.monotonic() < deadline:
        st = _stats(base)
        if ok(st):
            return st
        time.sleep(0.05)
    raise AssertionError(f"{what} not within {timeout_s} s; last /stats {st}")


class Stream(threading.Thread):
    """One streamed completion, read to its end."""

    def __init__(self, base: str, i: int) -> None:
        super().__init__(daemon=True)
        self.base, self.i = base, i
        self.status: int | None = None
        self.last: str | None = None

    def run(self) -> None:
        body = {"prompt": f"hold {self.i}", **HOLD}
        with httpx.stream(
            "POST", self.base + "/v1/completions", json=body, timeout=300, trust_env=False
        ) as r:
            self.status = r.status_code
            for line in r.iter_lines():
                if line.startswith("data: "):
                    self.last = line[len("data: ") :]


@pytest.mark.ray
@pytest.mark.slow
def test_the_replica_admits_the_limit_the_serve_actuator_sets(deployed) -> None:
    from controller.backends.serve import ServeActuator
    from search.space import Knobs

    base = f"{deployed.http_url}/{APP}"
    before = _stats(base)
    assert before["live"].get("max_ongoing_requests") is None
    assert before["max_ongoing_requests"] == OLD

    actuator = ServeActuator(app=APP, dashboard_url=deployed.dashboard_url)
    cost = actuator.apply(Knobs(max_batch_size=3, max_concurrency=NEW))
    assert cost.changed and not cost.restarted
    # Both knobs in one update: the user's reconfigure ran (batch 3) while Serve's context
    # still held the old limit; the limit read afterwards is the new one.
    after = _wait_stats(base, f"limit {NEW}", lambda s: s["max_ongoing_requests"] == NEW)
    assert after["pid"] == before["pid"] and after["replica"] == before["replica"]
    assert after["max_batch_size"] == 3

    # More than the old limit in the engine at once (one place left for /stats itself).
    streams = [Stream(base, i) for i in range(NEW - 1)]
    for s in streams:
        s.start()
    try:
        held = _wait_stats(base, f"{NEW - 1} admitted", lambda s: s["admitted"] == NEW - 1)
        assert NEW - 1 > OLD and held["queued"] == 0 and held["pid"] == before["pid"]
    finally:
        for s in streams:
            s.join(300)
    for s in streams:
        assert not s.is_alive() and s.status == 200 and s.last == "[DONE]", (s.i, s.status)
    assert _stats(base)["pid"] == before["pid"]
