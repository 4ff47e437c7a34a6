"""Start the local Ray cluster (and Serve) that slotune runs on; deploying is serving.app.deploy.

The seam between "which Ray do we run on, and how is it secured" and "what do we deploy
on it".
"""

from __future__ import annotations

import os

# Process environment for a Ray driver on a small machine; Ray's processes inherit it
# (docs/serving.md "CPU settings"):
# - no usage stats; metrics exported every second (the minimum);
# - OMP_WAIT_POLICY=PASSIVE: spinning torch threads starve the other processes on
#   a few shared cores (a replica's own policy is ServerArgs.omp_wait_policy);
# - RAY_worker_niceness=0: Ray renices every worker process (replicas, the HTTP
#   proxy) to 15 by default, so any ordinary process on the machine takes the CPU
#   from the replica first; an SLO-serving replica whose latency the tuner measures
#   must compete on equal terms;
# - RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD=0: request handlers run on the
#   replica's main event loop, which saves a cross-thread hop per streamed event
#   (the handlers never block: the engine steps in its own thread).
RAY_ENV_DEFAULTS = {
    "RAY_USAGE_STATS_ENABLED": "0",
    "RAY_metrics_report_interval_ms": "1000",
    "OMP_WAIT_POLICY": "PASSIVE",
    "RAY_worker_niceness": "0",
    "RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD": "0",
}


def ray_env_defaults() -> None:
    """Set :data:`RAY_ENV_DEFAULTS` where the user has not set them (before ``ray.init``)."""
    for k, v in RAY_ENV_DEFAULTS.items():
        os.environ.setdefault(k, v)


def start_local_ray(
    *, num_cpus: int, metrics_port: int, http_port: int, host: str = "127.0.0.1"
) -> None:
    """Start Ray and Serve in this process, as lean as the machine needs.

    No dashboard, a 128 MiB object store, metrics on ``metrics_port`` (Ray's export
    port), Serve's HTTP proxy on ``host:http_port`` without access logs. If Serve does
    not start, Ray is shut down again before the error propagates.
    """
    ray_env_defaults()
    import ray
    from ray import serve
    from ray.serve.config import HTTPOptions
    from ray.serve.schema import LoggingConfig

    ray.init(
        num_cpus=num_cpus,
        include_dashboard=False,
        object_store_memory=128 << 20,
        log_to_driver=False,
        _metrics_export_port=metrics_port,
    )
    try:
        serve.start(
            http_options=HTTPOptions(host=host, port=http_port),
            logging_config=LoggingConfig(enable_access_log=False),
        )
    except BaseException:
        ray.shutdown()
        raise
