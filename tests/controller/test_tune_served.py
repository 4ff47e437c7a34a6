"""The served calibration's cache: an older version is measured again, never misread."""

from __future__ import annotations

import json

import pytest

from controller import tune_served
from controller.targets import RequestShape
from search.calibrate.served import SERVED_VERSION, ServedModel, ServedPoint
from serving.sim.workload import LengthDist

SHAPE = RequestShape(prompt_tokens=LengthDist(mean=16), output_tokens=LengthDist(mean=8))


def _served() -> ServedModel:
    pts = [ServedPoint(batch=b, tpot_p50_s=0.01 * b, tpot_p99_s=0.02 * b) for b in (1, 4, 10, 16)]
    return ServedModel.fit(
        pts, model="slotune-small", device="cpu-x", threads=1, prompt_tokens=16, output_tokens=8
    )


def test_the_calibration_measures_four_batches_around_the_demo_knee() -> None:
    assert tune_served.SERVED_BATCHES == (1, 4, 10, 16)


def test_an_older_cache_is_measured_again(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "hw-served-slotune-small.json"
    old = {**_served().to_dict(), "version": SERVED_VERSION - 1}
    path.write_text(json.dumps(old))
    assert tune_served.load_served(path) is None  # recognised as old, not misread

    measured: list[int] = []

    def fake_measure(target: object, **kw: object) -> ServedModel:
        measured.append(1)
        return _served()

    monkeypatch.setattr(tune_served, "served_path", lambda *a: path)
    monkeypatch.setattr(tune_served, "measure_served", fake_measure)

    def served_for():
        return tune_served.served_for(
            object(),  # type: ignore[arg-type]
            device="cpu",
            threads=1,
            model="slotune-small",
            shape=SHAPE,
            quiet=True,
        )

    got, note = served_for()
    assert measured == [1] and "measured now" in note and got == _served()
    assert json.loads(path.read_text())["version"] == SERVED_VERSION
    got2, note2 = served_for()
    assert measured == [1] and got2 == got and "measured now" not in note2
