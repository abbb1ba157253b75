"""Fixtures shared by every test tier."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture
def workdir(tmp_path: Path) -> Path:
    """An empty directory to run the CLI in (its runs/ lands here)."""
    return tmp_path
