"""What a completion server replica is built with, and the knobs it takes live.

:class:`ServerArgs` are the application ``args`` (a change rebuilds the replica);
:class:`LiveConfig` is the deployment's ``user_config``, applied in place by the
replica's ``reconfigure``. Pure: no Ray, no torch (serving/app/server.py hosts them).
"""

from __future__ import annotations

import logging
import math
import os
import sys
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

from metrics.observation import DEFAULT_SLO, Slo

logger = logging.getLogger(__name__)

DEPLOYMENT_NAME = "CompletionServer"
# Admission defaults of the deployment: requests a replica lets into its engine at once
# (its batch and the engine's queue), and requests it queues beyond those before it
# answers 429 (serving/app/admission.py).
DEFAULT_MAX_ONGOING_REQUESTS = 16
DEFAULT_MAX_QUEUED_REQUESTS = 64
# The default body-size limit: a JSON body for a full context. A token of a real
# vocabulary is rarely over 16 bytes of UTF-8, and JSON escaping (``\uXXXX``) can write
# one byte as six: 128 bytes a token bounds both, with room for the other fields.
BODY_BYTES_PER_TOKEN = 128
MIN_MAX_REQUEST_BYTES = 1 << 20
MODEL_PRESETS = ("tiny", "small")
DEVICES = ("cpu", "cuda")
OMP_WAIT_POLICIES = ("passive", "active")
# Where replicas publish the live config they applied (Ray's internal KV):
# key f"{app_name}/{replica_tag}", value JSON (see CompletionServer._publish).
KV_NAMESPACE = "slotune"
# Streaming pace (docs/serving.md "Streaming pace"): a token is held at most
# DEFAULT_STREAM_INTERVAL_S; the replica's streamed events stay near
# DEFAULT_STREAM_EVENTS_PER_S, so a lone request streams every token and only a
# full batch gets the whole interval (Ray Serve's cost is per event, not per token).
DEFAULT_STREAM_INTERVAL_S = 0.2
DEFAULT_STREAM_EVENTS_PER_S = 150.0
# Environment of every replica process, carried in the app's ``runtime_env``
# (serving.app.deploy.app_config, deploy/serve-config.yaml) so that it holds wherever
# the app runs, not only on a Ray that slotune started (serving.app.cluster.RAY_ENV_DEFAULTS
# sets the same for the whole local cluster, the HTTP proxy included):
# - RAY_worker_niceness=0: Ray renices worker processes to 15, so any ordinary
#   process on the machine takes the CPU from the replica first (Ray's own job
#   supervisor actor is started with this same runtime_env variable);
# - RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD=0: request handlers run on the
#   replica's main event loop (one cross-thread hop less per streamed event).
REPLICA_ENV_VARS: dict[str, str] = {
    "RAY_worker_niceness": "0",
    "RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD": "0",
}


def _is_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_pos_number(v: object) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v > 0


def check_served_model_name(name: object) -> None:
    """ValueError unless ``name`` can be the id a replica serves: a non-empty string with
    no whitespace. Clients send it back verbatim as a request's ``model`` and any other
    value is refused, so a stray space (from a shell or a config file) would turn every
    request that names the model as users write it into an error."""
    if not isinstance(name, str) or not name or any(c.isspace() for c in name):
        raise ValueError(
            f"served_model_name={name!r}: must be a non-empty string without whitespace"
        )


@dataclass(frozen=True, kw_only=True)
class ServerArgs:
    """What a replica is built with (the application ``args``): a change restarts it."""

    model: str = "tiny"
    max_slots: int = 64  # KV-cache slots: the largest batch the replica can ever run
    device: str = "cpu"
    checkpoint: str | None = None  # local HF-layout directory, or None for random weights
    max_len: int | None = None  # context per slot (prompt + output); None: the engine's default
    seed: int = 0
    torch_threads: int = 1  # Ray sets OMP_NUM_THREADS=1 in actors: choose deliberately
    # OpenMP's idle policy for torch's worker threads, set before torch loads; it only
    # matters with torch_threads > 1. "passive": idle workers sleep (the safe choice
    # when other processes share the cores); "active": they spin (faster on cores the
    # replica has to itself; docs/serving.md "CPU settings"). None keeps the process
    # environment's OMP_WAIT_POLICY, and PASSIVE when it has none.
    omp_wait_policy: str | None = None
    served_model_name: str | None = None  # the id /v1/models reports (see served_name)
    # Streaming pace (serving/engine/async_engine.py): the first token and the end go out at
    # once; in between a request's tokens are handed over at most once per
    # min(stream_interval_s, paced streams / stream_events_per_s) seconds, so a token
    # is held at most stream_interval_s. Interval 0: every token at once; events 0:
    # no budget, always the full interval.
    stream_interval_s: float = DEFAULT_STREAM_INTERVAL_S
    stream_events_per_s: float = DEFAULT_STREAM_EVENTS_PER_S
    # Largest request body read (413 beyond, from Content-Length before reading). None:
    # BODY_BYTES_PER_TOKEN per token of context, at least MIN_MAX_REQUEST_BYTES.
    max_request_bytes: int | None = None

    def __post_init__(self) -> None:
        if self.model not in MODEL_PRESETS:
            raise ValueError(f"model={self.model!r}: must be one of {MODEL_PRESETS}")
        if not _is_int(self.max_slots) or self.max_slots < 1:
            raise ValueError(f"max_slots={self.max_slots!r}: must be a positive integer")
        if self.device.split(":")[0] not in DEVICES:
            raise ValueError(f"device={self.device!r}: must be 'cpu' or 'cuda[:N]'")
        if self.max_len is not None and (not _is_int(self.max_len) or self.max_len < 2):
            raise ValueError(f"max_len={self.max_len!r}: must be an integer >= 2 or None")
        if not _is_int(self.seed):
            raise ValueError(f"seed={self.seed!r}: must be an integer")
        s = self.stream_interval_s
        if isinstance(s, bool) or not isinstance(s, (int, float)) or not 0 <= s <= 1:
            raise ValueError(f"stream_interval_s={s!r}: must be a number of seconds in [0, 1]")
        e = self.stream_events_per_s
        if isinstance(e, bool) or (e != 0 and not _is_pos_number(e)):
            raise ValueError(f"stream_events_per_s={e!r}: must be a number >= 0 (0: no budget)")
        if not _is_int(self.torch_threads) or self.torch_threads < 1:
            raise ValueError(f"torch_threads={self.torch_threads!r}: must be a positive integer")
        b = self.max_request_bytes
        if b is not None and (not _is_int(b) or b < 1024):
            raise ValueError(f"max_request_bytes={b!r}: must be an integer >= 1024 or None")
        p = self.omp_wait_policy
        if p is not None and p not in OMP_WAIT_POLICIES:
            raise ValueError(f"omp_wait_policy={p!r}: must be one of {OMP_WAIT_POLICIES} or None")
        if self.served_model_name is not None:
            check_served_model_name(self.served_model_name)

    def request_bytes_limit(self, context: int) -> int:
        """The body-size limit for a replica whose slots hold ``context`` tokens."""
        if self.max_request_bytes is not None:
            return self.max_request_bytes
        return max(MIN_MAX_REQUEST_BYTES, BODY_BYTES_PER_TOKEN * context)

    @property
    def served_name(self) -> str:
        """The id /v1/models reports: ``served_model_name``, else the checkpoint folder's
        name (not the preset's: the preset is not what a checkpoint serves), else
        ``slotune-<model>``."""
        if self.served_model_name:
            return self.served_model_name
        if self.checkpoint:
            return Path(self.checkpoint.rstrip("/")).name
        return f"slotune-{self.model}"

    @classmethod
    def from_args(cls, args: dict[str, Any] | None) -> ServerArgs:
        args = dict(args or {})
        allowed = {f.name for f in fields(cls)}
        unknown = sorted(set(args) - allowed)
        if unknown:
            raise ValueError(f"unknown app args {unknown}; allowed: {sorted(allowed)}")
        return cls(**args)

    def to_args(self) -> dict[str, Any]:
        return {k: v for k, v in asdict(self).items() if v is not None}


@dataclass(frozen=True, kw_only=True)
class LiveConfig:
    """The deployment's ``user_config``: applied in place by ``reconfigure``.

    ``max_batch_size`` is the decode batch limit (at most the replica's
    ``ServerArgs.max_slots``: :meth:`check_fits`); ``ttft_p99_s``/``tpot_p99_s`` are the
    SLO the replica's ``slo_met`` counter judges by (:attr:`slo`).
    ``max_ongoing_requests`` is the admission limit: requests the replica lets into its
    engine at once; ``max_queued_requests`` more may wait in the replica, and any beyond
    get a 429 at once (serving/app/admission.py). With a bounded queue, the deployment's
    own Serve option ``max_ongoing_requests`` is set above their sum
    (serving/app/deploy.py ``app_config``), so the replica, not Serve's proxy, decides.
    Carrying them here makes ``reconfigure`` run when they change, so the replica can
    confirm the update (serving/app/deploy.py waits on it). Unset, the replica admits the
    deployment's own ``max_ongoing_requests``, read live, with no queue of its own (Serve's
    router queues): the form for a deployment whose admission limit is tuned in its
    Serve config (controller/backends/serve.py), so ``max_queued_requests`` needs it.
    ``version`` is a nonce that makes each update distinguishable.
    """

    max_batch_size: int
    ttft_p99_s: float = DEFAULT_SLO.ttft_p99_s
    tpot_p99_s: float = DEFAULT_SLO.tpot_p99_s
    max_ongoing_requests: int | None = None
    # Requests the replica queues beyond max_ongoing_requests before it answers 429
    # (serving/app/admission.py); None: Serve's router queues them, unbounded.
    max_queued_requests: int | None = None
    version: str = ""

    def __post_init__(self) -> None:
        if not _is_int(self.max_batch_size) or self.max_batch_size < 1:
            raise ValueError(f"max_batch_size={self.max_batch_size!r}: must be a positive integer")
        _ = self.slo  # validates the thresholds
        m = self.max_ongoing_requests
        if m is not None and (not _is_int(m) or m < 1):
            raise ValueError(f"max_ongoing_requests={m!r}: must be a positive integer")
        q = self.max_queued_requests
        if q is not None and (not _is_int(q) or q < 0):
            raise ValueError(f"max_queued_requests={q!r}: must be an integer >= 0 or None")
        if q is not None and m is None:
            raise ValueError(
                f"max_queued_requests={q!r} without max_ongoing_requests: a replica queue needs "
                "the replica's own limit; set both, or neither (the deployment's limit applies)"
            )

    @property
    def slo(self) -> Slo:
        return Slo(ttft_p99_s=self.ttft_p99_s, tpot_p99_s=self.tpot_p99_s)

    def check_fits(self, args: ServerArgs) -> None:
        """ValueError unless a replica built with ``args`` can run this batch limit.

        The one check of the batch limit against the KV-cache capacity: the driver makes
        it before a config goes to Ray (serving/app/deploy.py), the replica when one
        arrives (``reconfigure``), so a hand-written config fails the same way.
        """
        if self.max_batch_size > args.max_slots:
            raise ValueError(
                f"max_batch_size={self.max_batch_size}: must be <= max_slots={args.max_slots}"
                " (a restart with larger max_slots raises it)"
            )

    @classmethod
    def from_user_config(cls, config: dict[str, Any]) -> LiveConfig:
        if not isinstance(config, dict):
            raise ValueError(f"user_config={config!r}: must be a mapping")
        allowed = {f.name for f in fields(cls)}
        unknown = sorted(set(config) - allowed)
        if unknown:
            raise ValueError(f"unknown user_config keys {unknown}; allowed: {sorted(allowed)}")
        return cls(**config)

    def to_user_config(self) -> dict[str, Any]:
        return {k: v for k, v in asdict(self).items() if v is not None and v != ""}


def set_omp_wait_policy(policy: str | None) -> str:
    """Set ``OMP_WAIT_POLICY`` for this process (None: keep it, PASSIVE if unset).

    OpenMP reads it once, when torch loads it: a replica calls this before it
    imports torch. Returns the value in force.
    """
    if policy is not None:
        os.environ["OMP_WAIT_POLICY"] = policy.upper()
    else:
        os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    if "torch" in sys.modules:
        logger.warning(
            "torch was imported before OMP_WAIT_POLICY=%s was set: the policy may not apply",
            os.environ["OMP_WAIT_POLICY"],
        )
    return os.environ["OMP_WAIT_POLICY"]
