"""Fixtures shared by every test tier, and each test's time limit."""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

import pytest

from helpers import SLOW_CHECKS_ENV, slow_checks
from limits import SHARED_DIR_ENV, grown, hang_limit

CALIBRATION_DIR_ENV = "TRAINWISE_CALIBRATION_DIR"  # trainwise.plan.calibrate's
OBJECTS_DIR_ENV = "TRAINWISE_OBJECTS_DIR"  # trainwise.objects': Python objects by value


def pytest_configure(config: pytest.Config) -> None:
    """A folder for the session's processes to share, which pytest-xdist's workers inherit
    (they start after this): the machine-speed measurement, made once by the first
    hang_limit call of any of them, and the runs they share (the fault tests' references)."""
    if SHARED_DIR_ENV not in os.environ:  # this is the controller, or a plain session
        folder = Path(tempfile.mkdtemp(prefix="trainwise-tests-"))
        os.environ[SHARED_DIR_ENV] = str(folder)
        config.add_cleanup(lambda: shutil.rmtree(folder, ignore_errors=True))
    # One intra-op thread in the tests' own processes, as cli_env gives the ones they start:
    # three pytest workers share 2 cores, and an op split over two threads waits for the one
    # that lost its core (unit files beside two busy loops: 43-45 -> 39 s of CPU).
    os.environ.setdefault("OMP_NUM_THREADS", "1")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """A test without its own timeout mark gets one launch's hang limit. A module whose
    fixture launches more marks its tests with hang_limit of that work (pytest-timeout
    counts a fixture's setup against the first test that uses it)."""
    if not slow_checks():  # their modules' launches leave out the runs they compare
        why = pytest.mark.skip(reason=f"a slow check: bench/slow_checks.sh runs it ({SLOW_CHECKS_ENV}=1)")
        for item in items:
            if item.get_closest_marker("slow_check") is not None:
                item.add_marker(why)
    unmarked = [item for item in items if item.get_closest_marker("timeout") is None]
    if unmarked:
        try:
            limit = hang_limit()
        except (AssertionError, RuntimeError) as err:  # the measurement itself failed
            raise pytest.UsageError(f"cannot size the tests' time limits: {err}") from err
        for item in unmarked:
            item.add_marker(pytest.mark.timeout(limit))


@pytest.hookimpl(hookwrapper=True, tryfirst=True)
def pytest_runtest_protocol(item: pytest.Item):
    """pytest-timeout reads a test's limit as the test starts: the mark, sized at
    collection, grown first with the machine's crowding since (limits.grown)."""
    marker = item.get_closest_marker("timeout")
    if marker is not None and marker.args:
        item.add_marker(pytest.mark.timeout(grown(float(marker.args[0]))), append=False)
    yield


@pytest.fixture
def workdir(tmp_path: Path) -> Path:
    """An empty directory to run the CLI in (its runs/ lands here)."""
    return tmp_path


@pytest.fixture(scope="module", autouse=True)
def module_calibration_dir(tmp_path_factory: pytest.TempPathFactory):
    """Machine calibrations (written by `trainwise doctor`, read by plan and train) in a
    directory of the test module's own, never the user's cache: in effect for the
    module's shared runs too (module fixtures start after this autouse one)."""
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
