"""Metrics profiles: under which names a server keeps TTFT, TPOT, completions and tokens.

A profile names the families a source reads (``slotune``'s own contract, vLLM's, SGLang's)
or says there are none (``client``: the load generator's own per-request records, which
include the network between it and the server). Names are as a plain prometheus_client
exporter shows them; under Ray's metrics export port they are read through
``names.read_as(name, prefix="ray_")`` (``vllm:x`` becomes ``ray_vllm_x``).

Where a name has changed between releases, every spelling is listed, newest first, and a
reader takes the first one the endpoint has. Bucket layouts are the servers' defaults, for
the stand-in server and the docs: a reader always takes the bounds the endpoint exposes.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

from metrics import names
from metrics.errors import MalformedExposition
from metrics.snapshot import Snapshot, parse_exposition

logger = logging.getLogger(__name__)

PROFILE_NAMES = ("slotune", "vllm", "sglang", "client")


@dataclass(frozen=True, kw_only=True)
class MetricsProfile:
    """Where one kind of server keeps the families an Observation is built from."""

    name: str
    # Histogram families (seconds), most preferred first.
    ttft: tuple[str, ...] = ()
    tpot: tuple[str, ...] = ()
    # Of ``tpot``, the families observed once per output token (inter-token latency),
    # not once per request: their p99 is token-weighted, which a reader notes.
    per_token: frozenset[str] = frozenset()
    # Counter of finished requests (sample names as exposed, ``_total`` included).
    completed: tuple[str, ...] = ()
    # The label that splits ``completed``: ``slo_met`` ("true"/"false": goodput is read
    # from the server) or a finish reason, whose ``not_completed`` values are left out.
    completed_by: str = ""
    slo_met_label: str = ""  # == completed_by when the server labels SLO-met requests
    not_completed: tuple[str, ...] = ()
    generated_tokens: tuple[str, ...] = ()
    rejected: tuple[str, ...] = ()
    # The label that gives a refusal's reason, and the values of it that mean "no room"
    # (HTTP 429): the refusals that are demand beyond the limits. With no such label every
    # refusal counts as "no room".
    rejected_by: str = ""
    no_room: tuple[str, ...] = ()
    # Gauges: an Observation carries the mean of the first two over its window.
    running: tuple[str, ...] = ()
    waiting: tuple[str, ...] = ()
    kv_usage: tuple[str, ...] = ()  # a fraction 0..1
    labels: tuple[str, ...] = ()  # label names the server puts on its series
    replica_label: str = ""  # of those, the one that tells replicas apart ('' : none does)
    buckets: Mapping[str, tuple[float, ...]] = field(default_factory=lambda: MappingProxyType({}))
    source: str = ""  # where the names come from (repository and file)

    def __post_init__(self) -> None:
        if self.name not in PROFILE_NAMES:
            raise ValueError(f"metrics profile {self.name!r}: must be one of {PROFILE_NAMES}")
        if self.server_side and not (self.ttft and self.tpot and self.completed):
            raise ValueError(f"metrics profile {self.name!r}: needs ttft, tpot and completed")
        if not self.per_token <= set(self.tpot):
            raise ValueError(f"per_token={sorted(self.per_token)!r}: must be among tpot")
        if self.slo_met_label not in ("", self.completed_by):
            raise ValueError(f"slo_met_label={self.slo_met_label!r}: must be completed_by or ''")
        if bool(self.rejected_by) != bool(self.no_room):
            raise ValueError(
                f"rejected_by={self.rejected_by!r}, no_room={self.no_room!r}: give both or neither"
            )

    @property
    def server_side(self) -> bool:
        """Whether the profile reads server metrics (every profile but ``client``)."""
        return self.name != "client"

    @property
    def counts_slo_met(self) -> bool:
        """Whether the server labels completions by SLO (goodput read from the server)."""
        return bool(self.slo_met_label)

    @staticmethod
    def counter_samples(families: tuple[str, ...], *, prefix: str) -> list[str]:
        """Every sample name under which one of the counter ``families`` may be exposed."""
        return [n for f in families for n in names.counter_samples(f, prefix=prefix)]

    def split_completed(self, by_label: Mapping[str, float]) -> tuple[float | None, float]:
        """``(met, missed)`` from the completion counter's window increases keyed by the
        ``completed_by`` label's value. ``met`` is None when the server does not label its
        completions by SLO; ``missed`` is then every completion (``not_completed`` left out)."""
        if self.counts_slo_met:
            met = by_label.get("true", 0.0)
            return met, sum(v for k, v in by_label.items() if k != "true")
        return None, sum(v for k, v in by_label.items() if k not in self.not_completed)

    def split_rejected(self, by_reason: Mapping[str, float]) -> tuple[float, float]:
        """``(rejected, overloaded)`` from the refusal counter's window increases keyed by
        the ``rejected_by`` label's value (one key, "", when the profile has no such label)."""
        total = sum(by_reason.values())
        if not self.rejected_by:
            return total, total
        return total, sum(v for k, v in by_reason.items() if k in self.no_room)

    def tpot_remark(self, family: str | None) -> str:
        """A note when TPOT is read from a per-token family (empty otherwise)."""
        if family is None or family not in self.per_token:
            return ""
        return f"TPOT read from {family}: observed per output token, so its p99 is token-weighted"


SLOTUNE = MetricsProfile(
    name="slotune",
    ttft=(names.TTFT_SECONDS,),
    tpot=(names.TPOT_SECONDS,),
    completed=(names.REQUESTS_TOTAL,),
    completed_by=names.LABEL_SLO_MET,
    slo_met_label=names.LABEL_SLO_MET,
    generated_tokens=(names.GENERATED_TOKENS_TOTAL,),
    rejected=(names.REJECTED_TOTAL,),
    rejected_by=names.LABEL_REASON,
    no_room=(names.REASON_OVERLOADED,),
    running=(names.RUNNING_REQUESTS,),
    waiting=(names.WAITING_REQUESTS,),
    kv_usage=(names.KV_CACHE_USAGE_RATIO,),
    labels=("application", "deployment", "replica"),
    replica_label="replica",
    buckets=MappingProxyType(
        {names.TTFT_SECONDS: names.TTFT_BUCKETS, names.TPOT_SECONDS: names.TPOT_BUCKETS}
    ),
    source="metrics/names.py",
)

# vllm-project/vllm, vllm/v1/metrics/loggers.py (PrometheusStatLogger): TTFT, inter-token
# latency and per-request TPOT histograms with these bounds; labels model_name, engine
# (request_success adds finished_reason: stop, length, abort, error, repetition, per
# vllm/v1/engine/__init__.py FINISH_REASON_STRINGS; aborted requests are counted too).
# request_time_per_output_token is observed once per finished request as
# (last token - first token) / (tokens - 1), the same TPOT as slotune's; older releases
# (vllm/engine/metrics.py in v0, and v1 before 0.11) had only time_per_output_token,
# observed once per output token. The KV gauge was gpu_cache_usage_perc before 0.9.
# Under Ray Serve LLM (ray.llm, log_engine_metrics) the same names go through
# vllm/v1/metrics/ray_wrappers.py (':' -> '_') and gain a ReplicaId label.
VLLM_TTFT_BUCKETS = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
    10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
)  # fmt: skip
VLLM_TPOT_BUCKETS = (
    0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
    10.0, 20.0, 40.0, 80.0,
)  # fmt: skip
VLLM = MetricsProfile(
    name="vllm",
    ttft=("vllm:time_to_first_token_seconds",),
    tpot=(
        "vllm:request_time_per_output_token_seconds",
        "vllm:inter_token_latency_seconds",
        "vllm:time_per_output_token_seconds",
    ),
    per_token=frozenset({"vllm:inter_token_latency_seconds", "vllm:time_per_output_token_seconds"}),
    completed=("vllm:request_success_total",),
    completed_by="finished_reason",
    not_completed=("abort", "error"),
    generated_tokens=("vllm:generation_tokens_total",),
    running=("vllm:num_requests_running",),
    waiting=("vllm:num_requests_waiting",),
    kv_usage=("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc"),
    labels=("model_name", "engine"),
    buckets=MappingProxyType(
        {
            "vllm:time_to_first_token_seconds": VLLM_TTFT_BUCKETS,
            "vllm:request_time_per_output_token_seconds": VLLM_TPOT_BUCKETS,
            "vllm:inter_token_latency_seconds": VLLM_TPOT_BUCKETS,
            "vllm:time_per_output_token_seconds": VLLM_TPOT_BUCKETS,
        }
    ),
    source="vllm-project/vllm vllm/v1/metrics/loggers.py",
)

# sgl-project/sglang, python/sglang/srt/metrics/collector.py: TokenizerMetricsCollector
# (TTFT, inter-token latency observed per output token, num_requests_total counted once per
# finished request, num_aborted_requests_total apart) and SchedulerMetricsCollector (the
# gauges); labels model_name plus any extra_metric_labels (Ray Serve LLM adds application,
# deployment, replica). Older releases had time_per_output_token_seconds instead of ITL.
SGLANG_TTFT_BUCKETS = (
    0.1, 0.2, 0.4, 0.6, 0.8, 1.0, 2.0, 4.0, 6.0, 8.0, 10.0, 20.0, 40.0, 60.0, 80.0, 100.0,
    200.0, 400.0,
)  # fmt: skip
SGLANG_ITL_BUCKETS = (
    0.002, 0.004, 0.006, 0.008, 0.01, 0.015, 0.02, 0.025, 0.03, 0.035, 0.04, 0.06, 0.08,
    0.1, 0.2, 0.4, 0.6, 0.8, 1.0, 2.0, 4.0, 6.0, 8.0,
)  # fmt: skip
SGLANG = MetricsProfile(
    name="sglang",
    ttft=("sglang:time_to_first_token_seconds",),
    tpot=("sglang:inter_token_latency_seconds", "sglang:time_per_output_token_seconds"),
    per_token=frozenset(
        {"sglang:inter_token_latency_seconds", "sglang:time_per_output_token_seconds"}
    ),
    completed=("sglang:num_requests_total",),
    generated_tokens=("sglang:generation_tokens_total",),
    running=("sglang:num_running_reqs",),
    waiting=("sglang:num_queue_reqs",),
    kv_usage=("sglang:token_usage",),
    labels=("model_name",),
    buckets=MappingProxyType(
        {
            "sglang:time_to_first_token_seconds": SGLANG_TTFT_BUCKETS,
            "sglang:inter_token_latency_seconds": SGLANG_ITL_BUCKETS,
        }
    ),
    source="sgl-project/sglang python/sglang/srt/metrics/collector.py",
)

# No server metrics: the load generator's records (TTFT and TPOT as the client saw them,
# network included; goodput exact per request).
CLIENT = MetricsProfile(name="client", source="the load generator's per-request records")

PROFILES: Mapping[str, MetricsProfile] = MappingProxyType(
    {p.name: p for p in (SLOTUNE, VLLM, SGLANG, CLIENT)}
)


def profile(name: str) -> MetricsProfile:
    """The profile called ``name`` (one of :data:`PROFILE_NAMES`)."""
    try:
        return PROFILES[name]
    except KeyError:
        raise ValueError(f"metrics profile {name!r}: must be one of {PROFILE_NAMES}") from None


def _prefixes(snap: Snapshot, prof: MetricsProfile) -> list[str]:
    """The prefixes ('' or 'ray_') under which ``prof``'s TTFT histogram is in ``snap``."""
    return [
        p
        for p in ("", names.RAY_PREFIX)
        if any(snap.has(names.histogram_samples(n, prefix=p)[0]) for n in prof.ttft)
    ]


def detect_snapshot(snap: Snapshot) -> tuple[str, str] | None:
    """``(profile name, prefix)`` of the first server profile whose TTFT histogram ``snap``
    holds (slotune, then vLLM, then SGLang); None when there is none."""
    for prof in PROFILES.values():
        if prof.server_side and (found := _prefixes(snap, prof)):
            return prof.name, found[0]
    return None


def detect(exposition_text: str) -> str | None:
    """The profile of a metrics endpoint's text, when the user did not name one.

    The first server profile whose TTFT histogram is there, read plainly or under Ray's
    ``ray_`` prefix; None when none is (or the text is not Prometheus exposition): then the
    profile must be given, or ``client`` used.
    """
    try:
        snap = parse_exposition(exposition_text, time_s=0.0)
    except MalformedExposition as e:
        logger.warning("cannot detect a metrics profile: %s", e)
        return None
    found = detect_snapshot(snap)
    return None if found is None else found[0]
