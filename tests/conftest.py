"""Shared fixtures: one Ray cluster per session; a real Prometheus where marked; a vLLM
stand-in server (vLLM-named metrics, simulated engine) where a test asks for one."""

from __future__ import annotations

import pytest

from tests.fixtures.prometheus_server import prometheus_server  # noqa: F401
from tests.fixtures.ray_cluster import ray_cluster  # noqa: F401
from tests.fixtures.vllm_standin import vllm_standin  # noqa: F401


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    try:
        import torch

        has_cuda = torch.cuda.is_available()
    except Exception:  # pragma: no cover - torch is a hard dependency
        has_cuda = False
    skip_gpu = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords and not has_cuda:
            item.add_marker(skip_gpu)
