"""One controller per deployment on Kubernetes: a ``coordination.k8s.io/v1`` Lease.

The same protocol as client-go's leader election (k8s.io/client-go/tools/leaderelection,
``resourcelock.LeaseLock``): the Lease names its holder and when it last renewed; another
holder may take it only once ``renewTime + leaseDurationSeconds`` has passed. Every write
carries the resourceVersion it read, so of two controllers racing for an expired Lease the
API server lets one through (409 for the other). The holder renews it every tick; a
controller that finds it renewed by someone else has lost it and stops. On a clean exit the
Lease is given up (holder cleared), so a successor need not wait for it to expire.

A pod restarted in place keeps its name (the holder identity, ``HOSTNAME``) and takes its
own Lease back at once; a new pod waits for the old holder's Lease to expire (it exits with
the time left; the Deployment restarts it).
"""

from __future__ import annotations

import datetime as dt
import logging
import math
import os
import socket
import time
from collections.abc import Callable
from typing import Any

from controller.backends.actuator import ActuatorUnavailable
from controller.backends.kube import (
    REQUEST_TIMEOUT_S,
    api_client,
    is_conflict,
    kube_error,
    read_object,
)
from controller.control.store import LeaseHeld

log = logging.getLogger(__name__)

GROUP, VERSION, PLURAL = "coordination.k8s.io", "v1", "leases"


class LeaseLost(RuntimeError):
    """Another controller took the Lease while this one held it."""


def lease_name(rayservice: str) -> str:
    return f"slotune-control-{rayservice}"


def holder_identity() -> str:
    """This controller's name in the Lease: the pod's name (HOSTNAME), which a container
    restarted in the same pod keeps."""
    return os.environ.get("HOSTNAME") or socket.gethostname()


def _micro(t: float) -> str:
    """A MicroTime as the API server parses it: RFC 3339 with exactly six fraction digits.
    (Hence dicts through ``CustomObjectsApi``: the typed ``CoordinationV1Api`` of client 37
    turns them into datetimes and sends ``isoformat()``, which drops the fraction at whole
    seconds and is refused with 400.)"""
    return dt.datetime.fromtimestamp(t, tz=dt.UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def _seconds(x: Any) -> float | None:
    if x is None:
        return None
    if isinstance(x, dt.datetime):
        return (x if x.tzinfo else x.replace(tzinfo=dt.UTC)).timestamp()
    return dt.datetime.fromisoformat(str(x).replace("Z", "+00:00")).timestamp()


class KubeLease:
    """Hold the Lease ``name`` in ``namespace`` while the controller runs (a context manager
    like :class:`~controller.control.store.Lease`, plus :meth:`renew` each tick)."""

    def __init__(
        self,
        name: str,
        namespace: str,
        *,
        duration_s: float,
        identity: str | None = None,
        api: Any = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        if not (math.isfinite(duration_s) and duration_s >= 1):
            raise ValueError(f"duration_s={duration_s!r}: must be >= 1 second")
        if api is None:
            from kubernetes import client

            api = client.CustomObjectsApi(api_client())
        self.api = api
        self.name, self.namespace = name, namespace
        self.duration_s = int(math.ceil(duration_s))
        self.identity = identity or holder_identity()
        self.clock = clock
        self.what = f"Lease {namespace}/{name}"
        self._held = False
        self._renewed_s = -math.inf

    # -- API calls ------------------------------------------------------------------

    def _call(self, method: str, *args: Any) -> Any:
        try:
            return getattr(self.api, method)(
                GROUP, VERSION, self.namespace, PLURAL, *args, _request_timeout=REQUEST_TIMEOUT_S
            )
        except Exception as e:
            if is_conflict(e):
                raise
            raise kube_error(e, self.what) from None

    def _read(self) -> dict[str, Any] | None:
        """The Lease, or None when there is none."""
        return read_object(
            self.api, GROUP, VERSION, self.namespace, PLURAL, self.name, what=self.what
        )

    def _body(self, now: float, *, acquire_s: float, transitions: int, rv: str | None) -> Any:
        """The Lease as a dict (the client's models would send MicroTime wrongly)."""
        meta: dict[str, Any] = {"name": self.name, "namespace": self.namespace}
        if rv is not None:
            meta["resourceVersion"] = rv
        return {
            "apiVersion": "coordination.k8s.io/v1",
            "kind": "Lease",
            "metadata": meta,
            "spec": {
                "holderIdentity": self.identity,
                "leaseDurationSeconds": self.duration_s,
                "acquireTime": _micro(acquire_s),
                "renewTime": _micro(now),
                "leaseTransitions": transitions,
            },
        }

    # -- the protocol -----------------------------------------------------------------

    def _rewrite(self, lease: dict[str, Any], *, mine: bool) -> dict[str, Any]:
        """``lease`` renewed by this controller now: the acquire time and transition count
        kept when it was already ours, a new acquisition otherwise."""
        spec, now = lease.get("spec") or {}, self.clock()
        return self._body(
            now,
            acquire_s=(_seconds(spec.get("acquireTime")) or now) if mine else now,
            transitions=int(spec.get("leaseTransitions") or 0) + (0 if mine else 1),
            rv=lease["metadata"]["resourceVersion"],
        )

    def acquire(self) -> None:
        now = self.clock()
        lease = self._read()
        try:
            if lease is None:
                body = self._body(now, acquire_s=now, transitions=0, rv=None)
                self._call("create_namespaced_custom_object", body)
            else:
                spec = lease.get("spec") or {}
                holder = spec.get("holderIdentity") or ""
                renewed = _seconds(spec.get("renewTime")) or 0.0
                expires = renewed + float(spec.get("leaseDurationSeconds") or 0)
                if holder and holder != self.identity and now < expires:
                    raise LeaseHeld(
                        f"{self.what} is held by {holder!r} (renewed {now - renewed:.0f} s "
                        f"ago, expires in {expires - now:.0f} s): one controller per deployment"
                    )
                body = self._rewrite(lease, mine=holder == self.identity)
                self._call("replace_namespaced_custom_object", self.name, body)
        except Exception as e:
            if is_conflict(e):  # created or renewed by another controller since the read
                raise LeaseHeld(f"{self.what}: taken by another controller just now") from None
            raise
        self._held = True
        self._renewed_s = now

    def renew(self) -> str:
        """Extend the Lease: "" when done; why not when the API server cannot be reached
        now (the Lease is still ours until it expires, but this tick must not act on it);
        LeaseLost when another holder has it, or when it went unrenewed for its duration."""
        try:
            lease = self._read()
            holder = None if lease is None else (lease.get("spec") or {}).get("holderIdentity")
            if lease is None or holder != self.identity:
                self._held = False
                raise LeaseLost(
                    f"{self.what} is now held by {holder!r}, not {self.identity!r}: stopping"
                )
            body = self._rewrite(lease, mine=True)
            self._call("replace_namespaced_custom_object", self.name, body)
        except ActuatorUnavailable as e:
            unrenewed = self.clock() - self._renewed_s
            if unrenewed >= self.duration_s:
                self._held = False
                raise LeaseLost(
                    f"{self.what} not renewed for {unrenewed:.0f} s, its whole duration "
                    f"({e}): another controller may hold it now; stopping"
                ) from None
            return f"the Lease could not be renewed ({e}); not acting this tick"
        except Exception as e:
            if is_conflict(e):
                self._held = False
                raise LeaseLost(f"{self.what} changed under its holder: stopping") from None
            raise
        self._renewed_s = self.clock()
        return ""

    def release(self) -> None:
        """Give the Lease up (holder cleared) if still ours; errors are only logged."""
        if not self._held:
            return
        self._held = False
        try:
            lease = self._read()
            if lease is None or (lease.get("spec") or {}).get("holderIdentity") != self.identity:
                return
            body = self._rewrite(lease, mine=True)
            body["spec"].update(holderIdentity=None, leaseDurationSeconds=1)
            self._call("replace_namespaced_custom_object", self.name, body)
        except Exception as e:  # it expires on its own
            log.warning("releasing %s failed: %s", self.what, e)

    def __enter__(self) -> KubeLease:
        self.acquire()
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()
