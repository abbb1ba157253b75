"""Fixtures shared by every test tier."""

from __future__ import annotations

from pathlib import Path

import pytest

CALIBRATION_DIR_ENV = "TRAINWISE_CALIBRATION_DIR"  # trainwise.plan.calibrate's
OBJECTS_DIR_ENV = "TRAINWISE_OBJECTS_DIR"  # trainwise.objects': Python objects by value


@pytest.fixture
def workdir(tmp_path: Path) -> Path:
    """An empty directory to run the CLI in (its runs/ lands here)."""
    return tmp_path


@pytest.fixture(scope="module", autouse=True)
def module_calibration_dir(tmp_path_factory: pytest.TempPathFactory):
    """Machine calibrations (written by `trainwise doctor`, read by plan and train) in a
    directory of the test module's own, never the user's cache: in effect for the
    module's shared runs too (module fixtures start after this autouse one)."""
    import os

    old = {name: os.environ.get(name) for name in (CALIBRATION_DIR_ENV, OBJECTS_DIR_ENV)}
    os.environ[CALIBRATION_DIR_ENV] = str(tmp_path_factory.mktemp("calibrations"))
    # Objects trainwise.train() sends by value: never into the user's cache.
    os.environ[OBJECTS_DIR_ENV] = str(tmp_path_factory.mktemp("objects"))
    yield
    for name, value in old.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value


@pytest.fixture(autouse=True)
def calibration_dir(tmp_path_factory: pytest.TempPathFactory, monkeypatch) -> Path:
    """And one of each test's own, for what the test itself starts."""
    folder = tmp_path_factory.mktemp("calibrations")
    monkeypatch.setenv(CALIBRATION_DIR_ENV, str(folder))
    return folder
