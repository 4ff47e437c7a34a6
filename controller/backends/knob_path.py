"""Knob paths into a Serve application config, and which changes restart replicas.

A knob path is dotted with list indices, e.g. ``user_config.max_batch_size`` or
``args.llm_configs[0].engine_kwargs.max_num_seqs``. It is read in the deployment's entry
of the app's ``deployments`` list, unless its first key is a field of the application
itself (:data:`APP_FIELDS`: ``args``, ``runtime_env``...), then in the app's entry. Pure:
no I/O, dicts in, dicts out.

The guard (:func:`classify`, :func:`restarting_changes`) follows Ray Serve 2.60:

- an application's code version is a hash of its ``import_path``, ``runtime_env``,
  ``args``, ``autoscaling_policy``, its deployments' autoscaling policies,
  ``request_router_config`` dicts and ``deployment_actors``
  (ray/serve/_private/deploy_utils.py ``get_app_code_version``); a new code version
  rebuilds the app and restarts every replica;
- a deployment's replicas restart when its code version, ``ray_actor_options``,
  placement group options, ``max_replicas_per_node`` or gang scheduling config change
  (ray/serve/_private/version.py ``DeploymentVersion.requires_actor_restart``), and a
  ``HeavyWeight`` option (``version``, ``gang_scheduling_config``, ``deployment_actors``)
  changes the version (ray/serve/_private/config.py ``DeploymentConfig``);
- the other ``DeploymentConfig`` options are ``LightWeight``, ``NeedsReconfigure`` or
  ``NeedsActorReconfigure``: applied to running replicas (``user_config`` through the
  replica's ``reconfigure``).

Anything not in these tables is "unknown" and refused like a restart: slotune changes
only what it knows to be live.
"""

from __future__ import annotations

import copy
import re
from dataclasses import dataclass
from typing import Any

Part = str | int

# Fields of an application entry (ray/serve/schema.py ServeApplicationSchema) a knob path
# may start with; every other first key is read in the deployment's entry.
APP_FIELDS = frozenset(
    {"args", "runtime_env", "import_path", "route_prefix", "name", "autoscaling_policy"}
)
# Application fields hashed into its code version (deploy_utils.get_app_code_version).
APP_RESTART = frozenset({"args", "runtime_env", "import_path", "autoscaling_policy"})
# Deployment options applied to running replicas (config.py update types other than
# HeavyWeight). autoscaling_config is live but for its ``policy`` and its presence in the
# entry (code version: :func:`classify`).
DEPLOYMENT_LIVE = frozenset(
    {
        "num_replicas",
        "max_ongoing_requests",
        "max_queued_requests",
        "user_config",
        "autoscaling_config",
        "graceful_shutdown_timeout_s",
        "graceful_shutdown_wait_loop_s",
        "health_check_period_s",
        "health_check_timeout_s",
        "logging_config",
        "max_constructor_retry_count",
        "rolling_update_percentage",
        "max_surge_percent",
        "backpressure_config",
    }
)
# Deployment options whose change restarts replicas (version.py requires_actor_restart,
# config.py HeavyWeight, deploy_utils.get_app_code_version); ``name`` names another
# deployment altogether.
DEPLOYMENT_RESTART = frozenset(
    {
        "ray_actor_options",
        "placement_group_bundles",
        "placement_group_strategy",
        "placement_group_bundle_label_selector",
        "placement_group_fallback_strategy",
        "max_replicas_per_node",
        "version",
        "gang_scheduling_config",
        "deployment_actors",
        "request_router_config",
        "name",
    }
)
EFFECTS = ("live", "restart", "unknown")

_PART = re.compile(r"([A-Za-z_][A-Za-z0-9_\-]*)((?:\[\d+\])*)")


@dataclass(frozen=True, kw_only=True)
class KnobPath:
    """A parsed knob path: where it is read (``app`` or ``deployment``) and its keys."""

    scope: str
    parts: tuple[Part, ...]

    def __post_init__(self) -> None:
        if self.scope not in ("app", "deployment"):
            raise ValueError(f"scope={self.scope!r}: must be 'app' or 'deployment'")
        if not self.parts or not isinstance(self.parts[0], str):
            raise ValueError(f"parts={self.parts!r}: must start with a key")

    @classmethod
    def parse(cls, text: str) -> KnobPath:
        """``a.b[0].c`` -> parts ('a', 'b', 0, 'c'); ValueError naming the bad path."""
        parts: list[Part] = []
        for piece in text.split(".") if text else [""]:
            m = _PART.fullmatch(piece)
            if m is None:
                raise ValueError(
                    f"knob path {text!r}: {piece!r} is not a key (letters, digits, _ or -) "
                    "with optional [index]es; e.g. user_config.max_batch_size"
                )
            parts.append(m.group(1))
            parts.extend(int(i) for i in re.findall(r"\[(\d+)\]", m.group(2)))
        scope = "app" if parts[0] in APP_FIELDS else "deployment"
        return cls(scope=scope, parts=tuple(parts))

    def __str__(self) -> str:
        out = ""
        for p in self.parts:
            out += f"[{p}]" if isinstance(p, int) else (f".{p}" if out else p)
        return out


_MISSING = object()


def get_path(tree: Any, parts: tuple[Part, ...], default: Any = _MISSING) -> Any:
    """The value at ``parts`` in ``tree``; ``default`` if absent (KeyError without one)."""
    node = tree
    for p in parts:
        ok = (isinstance(p, int) and isinstance(node, list) and 0 <= p < len(node)) or (
            isinstance(p, str) and isinstance(node, dict) and p in node
        )
        if not ok:
            if default is _MISSING:
                raise KeyError(f"no {p!r} at {_render(parts[: parts.index(p)]) or 'the top'}")
            return default
        node = node[p]
    return node


def set_path(tree: Any, parts: tuple[Part, ...], value: Any) -> Any:
    """A deep copy of ``tree`` with ``value`` at ``parts``; missing dict keys are created
    (a missing list index is a KeyError: a list entry cannot be invented)."""
    out = copy.deepcopy(tree)
    node = out
    for i, p in enumerate(parts):
        last = i == len(parts) - 1
        if isinstance(p, int):
            if not (isinstance(node, list) and 0 <= p < len(node)):
                raise KeyError(f"no [{p}] at {_render(parts[:i]) or 'the top'}")
        elif not isinstance(node, dict):
            raise KeyError(f"{_render(parts[:i])} is not a mapping: cannot set {p!r}")
        elif not last and node.get(p) is None:
            node[p] = {}
        if last:
            node[p] = value
        else:
            node = node[p]
    return out


def _render(parts: tuple[Part, ...]) -> str:
    return str(KnobPath(scope="app", parts=parts)) if parts and isinstance(parts[0], str) else ""


def diff_paths(old: Any, new: Any, prefix: tuple[Part, ...] = ()) -> list[tuple[Part, ...]]:
    """Every path at which ``new`` differs from ``old`` (a key added or removed counts;
    lists of different lengths differ as a whole)."""
    if isinstance(old, dict) and isinstance(new, dict):
        out: list[tuple[Part, ...]] = []
        for k in sorted(set(old) | set(new), key=str):
            if k not in old or k not in new:
                out.append((*prefix, k))
            else:
                out.extend(diff_paths(old[k], new[k], (*prefix, k)))
        return out
    if isinstance(old, list) and isinstance(new, list) and len(old) == len(new):
        out = []
        for i, (a, b) in enumerate(zip(old, new, strict=True)):
            out.extend(diff_paths(a, b, (*prefix, i)))
        return out
    return [] if old == new else [prefix]


def classify(scope: str, parts: tuple[Part, ...]) -> str:
    """``live``, ``restart`` or ``unknown`` for a change at ``parts`` of an app entry
    (``scope='app'``) or of a deployment entry (``scope='deployment'``)."""
    if not parts:
        return "unknown"
    head = parts[0]
    if scope == "app":
        return "restart" if head in APP_RESTART else "unknown"
    if head in DEPLOYMENT_RESTART:
        return "restart"
    if head == "autoscaling_config" and (len(parts) == 1 or parts[1] == "policy"):
        # get_app_code_version hashes each entry's autoscaling_config ``policy``, None for
        # an entry without the mapping: a policy changed, or the mapping added or
        # dropped, is a new code version. Its other keys are live.
        return "restart"
    return "live" if head in DEPLOYMENT_LIVE else "unknown"


def app_changes(old_app: dict[str, Any], new_app: dict[str, Any]) -> list[tuple[str, str]]:
    """(path, effect) of every change between two entries of one application, paths
    written ``deployments[NAME].key`` inside deployments. Deployments are matched by name;
    an entry added or removed is an override added or dropped: its keys are classified."""
    out: list[tuple[str, str]] = []
    for parts in diff_paths(
        {k: v for k, v in old_app.items() if k != "deployments"},
        {k: v for k, v in new_app.items() if k != "deployments"},
    ):
        out.append((_render(parts), classify("app", parts)))
    old_deps = {d.get("name"): d for d in old_app.get("deployments") or []}
    new_deps = {d.get("name"): d for d in new_app.get("deployments") or []}
    for name in sorted(set(old_deps) | set(new_deps), key=str):
        where = f"deployments[{name}]"
        bare = {"name": name}  # no override: the deployment as its code defines it
        for parts in diff_paths(old_deps.get(name, bare), new_deps.get(name, bare)):
            out.append((f"{where}.{_render(parts)}", classify("deployment", parts)))
    return out


def restarting_changes(
    old_app: dict[str, Any], new_app: dict[str, Any], *, allowed: frozenset[str] = frozenset()
) -> list[tuple[str, str]]:
    """The changes of :func:`app_changes` that are not ``live`` and not allowed: a path in
    ``allowed`` (as :func:`app_changes` writes them), or a key added on the way to one."""

    def ok(path: str) -> bool:
        return any(path == a or a.startswith((f"{path}.", f"{path}[")) for a in allowed)

    return [(p, e) for p, e in app_changes(old_app, new_app) if e != "live" and not ok(p)]
