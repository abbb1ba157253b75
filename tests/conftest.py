"""Fixtures shared by every test tier."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture
def workdir(tmp_path: Path) -> Path:
    """An empty directory to run the CLI in (its runs/ lands here)."""
    return tmp_path


@pytest.fixture(autouse=True)
def calibration_dir(tmp_path_factory: pytest.TempPathFactory, monkeypatch) -> Path:
    """Machine calibrations (written by `trainwise doctor`, read by plan and train) in a
    directory of the test's own: never the user's cache."""
    folder = tmp_path_factory.mktemp("calibrations")
    monkeypatch.setenv("TRAINWISE_CALIBRATION_DIR", str(folder))
    return folder
