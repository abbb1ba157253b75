"""Fixtures of the fault tests."""

from __future__ import annotations

import pytest
from faulty import References


@pytest.fixture(scope="session")
def reference(tmp_path_factory: pytest.TempPathFactory) -> References:
    """The uninterrupted runs that interrupted ones must match."""
    return References(tmp_path_factory.mktemp("reference"))
