"""The ``serve-llm`` actuator: a Ray Serve LLM app (``ray.serve.llm:build_openai_app``, vLLM).

Where the knobs live in such an app (Ray 2.60 sources):

- The app's ``args`` are ``LLMServingArgs``: ``llm_configs``, a list of ``LLMConfig``
  (ray/llm/_internal/serve/core/ingress/builder.py ``LLMServingArgs``,
  ray/llm/_internal/serve/core/configs/llm_config.py). The engine's batch limit is vLLM's
  ``max_num_seqs`` in ``llm_configs[i].engine_kwargs``. ``args`` are hashed into the app's
  code version (ray/serve/_private/deploy_utils.py ``get_app_code_version``): a change
  rebuilds the app and RESTARTS its replicas (the engine reloads its weights and recaptures
  its graphs). This actuator allows exactly that restart, only when the batch value
  changes, and reports how long it took until every replica was RUNNING and the
  deployment HEALTHY again.
- ``llm_configs[i].deployment_config`` holds the LLM server deployment's Serve options
  (``max_ongoing_requests`` among them), but it is inside ``args``: changing it there
  would restart too. The app's ``deployments`` list overrides a built deployment's
  options by name (application_state.py ``override_deployment_info``), and a
  ``max_ongoing_requests`` change there is live (config.py: NeedsActorReconfigure). So the
  admission limit goes into that override entry.
- The deployment is named ``LLMServer:`` + the model id with ``/`` -> ``--`` and
  ``.`` -> ``_``, unless ``deployment_config.name`` names it
  (ray/llm/_internal/serve/core/server/builder.py ``build_llm_deployment``,
  ``_get_deployment_name``); the app's other deployment is the OpenAI ingress.
"""

from __future__ import annotations

from typing import Any

from controller.backends.actuator import ActuatorError, KnobEffects
from controller.backends.serve import ServeActuator, pick_deployment
from controller.backends.serve_rest import ServeRest, dashboard_url_of_cluster
from serving.app.cluster import read_token

LLM_PREFIX = "LLMServer:"


def llm_deployment_name(llm_config: dict[str, Any]) -> str:
    """The deployment name Ray Serve LLM gives an ``LLMConfig`` dict (without its prefix)."""
    named = (llm_config.get("deployment_config") or {}).get("name")
    if named:
        return str(named)
    model_id = (llm_config.get("model_loading_config") or {}).get("model_id")
    if not model_id:
        raise ActuatorError("llm_config has no model_loading_config.model_id")
    return str(model_id).replace("/", "--").replace(".", "_")


def llm_index(app_cfg: dict[str, Any], deployment: str) -> int:
    """Which of the app's ``args.llm_configs`` the ``deployment`` serves."""
    configs = (app_cfg.get("args") or {}).get("llm_configs")
    if not isinstance(configs, list) or not configs:
        raise ActuatorError(
            f"app {app_cfg.get('name')!r} has no args.llm_configs: not a Ray Serve LLM app "
            "(use --actuator serve)"
        )
    for i, c in enumerate(configs):
        if not isinstance(c, dict):
            raise ActuatorError(f"args.llm_configs[{i}] is a file path, not a config: unsupported")
        name = llm_deployment_name(c)
        if deployment == name or deployment.endswith(f":{name}"):
            return i
    raise ActuatorError(f"deployment {deployment!r} serves none of the app's llm_configs")


class ServeLLMActuator(ServeActuator):
    """A Ray Serve LLM app: admission limit live, batch limit (vLLM ``max_num_seqs``) by a
    measured restart."""

    name = "serve-llm"

    def __init__(self, *, app: str, deployment: str | None = None, **kw: Any) -> None:
        rest = kw.pop("rest", None) or ServeRest(
            kw.pop("dashboard_url", None) or dashboard_url_of_cluster(), token=read_token()
        )
        details = rest.details()
        dep = pick_deployment(details, app, deployment, prefix=LLM_PREFIX, role="the LLM server")
        cfg = (details.get("applications") or {}).get(app, {}).get("deployed_app_config") or {}
        self._index = llm_index(cfg, dep)
        super().__init__(app=app, deployment=dep, rest=rest, **kw)

    def default_batch_knob(self) -> str:
        return f"args.llm_configs[{self._index}].engine_kwargs.max_num_seqs"

    def allowed_restarts(self, batch_changes: bool) -> frozenset[str]:
        return frozenset({str(self.batch_path)}) if batch_changes else frozenset()

    def effects(self) -> KnobEffects:
        return KnobEffects(
            live=frozenset({"max_concurrency"}), restart=frozenset({"max_batch_size"})
        )
