"""The private Ray names serving/app/ray_private.py uses exist in the Ray it was written for.

Fails first on a Ray upgrade: re-read each name's source, then move RAY_VERSION.
"""

from __future__ import annotations

import dataclasses
import inspect

import pytest

from serving.app import ray_private


def test_written_against_the_installed_ray() -> None:
    import ray

    assert ray.__version__ == ray_private.RAY_VERSION


def test_the_private_names_it_uses_are_there() -> None:
    from ray._private import ray_constants, utils
    from ray.experimental import internal_kv
    from ray.serve._private import constants
    from ray.serve._private.client import ServeControllerClient
    from ray.serve._private.controller import ServeController
    from ray.serve.context import ReplicaContext, _get_global_client

    assert "raise_if_no_controller_running" in inspect.signature(_get_global_client).parameters
    for name in ("deploy_apps", "get_serve_details"):
        assert callable(getattr(ServeControllerClient, name))
    assert callable(getattr(ServeController, "get_app_configs", None))
    for name in ("_internal_kv_get", "_internal_kv_put", "_internal_kv_del"):
        assert "namespace" in inspect.signature(getattr(internal_kv, name)).parameters
    assert "_deployment_config" in {f.name for f in dataclasses.fields(ReplicaContext)}
    assert isinstance(constants.RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD, bool)
    assert isinstance(ray_constants.ENABLE_RAY_CLUSTER, bool)
    assert list(inspect.signature(utils.read_ray_address).parameters) == ["temp_dir"]


def test_serves_proxy_callback_is_read_from_the_variable_it_names() -> None:
    from ray.serve._private import constants, http_util

    # constants reads the variable at import; http_util calls the function it names and
    # appends the Starlette middlewares returned to the proxy's (configure_http_middlewares).
    src = inspect.getsource(constants)
    assert f'"{ray_private.PROXY_CALLBACK_ENV}"' in src
    assert hasattr(constants, ray_private.PROXY_CALLBACK_ENV)
    mw = inspect.getsource(http_util.configure_http_middlewares)
    assert ray_private.PROXY_CALLBACK_ENV in mw and "middlewares.extend" in mw
    assert "call_function_from_import_path" in mw
    # Serve's own middlewares go first, the callback's wrap them (outermost: first to run).
    apply = inspect.getsource(http_util._apply_middlewares)
    assert "[Middleware(RequestIdMiddleware)] + middlewares" in apply
    http_util.validate_http_proxy_callback_return(ray_private.proxy_middlewares())


def test_current_cluster_address_reads_the_file_under_ray_tmpdir(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("RAY_TMPDIR", str(tmp_path))
    assert ray_private.current_cluster_address() is None
    (tmp_path / "ray").mkdir()
    (tmp_path / "ray" / "ray_current_cluster").write_text("127.0.0.1:6379\n")
    assert ray_private.current_cluster_address() == "127.0.0.1:6379"


@pytest.mark.ray
def test_declarative_configs_and_kv_round_trip(ray_cluster) -> None:
    client = ray_private.serve_client(start=False)
    assert client is not None
    assert isinstance(ray_private.declarative_app_configs(client), dict)
    assert "applications" in ray_private.serve_details(client)
    ray_private.kv_put("probe", b"1", namespace="slotune-test")
    assert ray_private.kv_get("probe", namespace="slotune-test") == b"1"
    ray_private.kv_del("probe", namespace="slotune-test")
    assert ray_private.kv_get("probe", namespace="slotune-test") is None
