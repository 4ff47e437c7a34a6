"""Issue 17 item 10: a stale current-cluster file does not stop slotune from starting its own Ray.

A ``ray start`` that was killed leaves ``<ray temp dir>/ray_current_cluster`` naming a dead
GCS; a ``ray.init()`` without ``address="local"`` would try to attach to it. The test's
file lives under its own RAY_TMPDIR (Ray's temp dir is ``$RAY_TMPDIR/ray``:
ray/_common/utils.py ``get_default_system_temp_dir``), never under another run's /tmp/ray.
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

import pytest

from tests.reliability.ray_procs import child_env, free_port, start_serve, stop


@pytest.mark.ray
@pytest.mark.slow
def test_slotune_serve_starts_its_own_cluster_over_a_stale_file(monkeypatch) -> None:
    # A short path: Ray's unix sockets live under it (108-byte limit on their paths).
    tmp = Path(tempfile.mkdtemp(prefix="st"))
    try:
        dead = f"127.0.0.1:{free_port()}"  # nothing listens there
        (tmp / "ray").mkdir()
        (tmp / "ray" / "ray_current_cluster").write_text(dead)
        # The control: this is the file, and the address, Ray's "auto" would attach to.
        from serving.app.ray_private import current_cluster_address

        monkeypatch.setenv("RAY_TMPDIR", str(tmp))
        assert current_cluster_address() == dead

        proc, out = start_serve(child_env(RAY_TMPDIR=str(tmp)), run_for_s=1)
        try:
            assert "serving " in out and "(loopback, token auth)" in out, out
            assert dead not in out
            assert any(p.name.startswith("session_") for p in (tmp / "ray").iterdir())
            # `--for 1` ends it by itself. A SIGTERM sent while it is already shutting Ray
            # down can meet Ray's own exit path and abort (-6, seen once in CI), which is
            # not what this test is about: let it exit on its own.
            proc.wait(timeout=120)
        finally:
            stop(proc)
        assert proc.returncode == 0
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
