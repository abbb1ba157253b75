"""Fixtures of the fault tests."""

from __future__ import annotations

import pytest
from faulty import References

from helpers import shared_dir


@pytest.fixture(scope="session")
def reference() -> References:
    """The uninterrupted runs that interrupted ones must match, made once a session for all
    of its pytest-xdist workers."""
    return References(shared_dir() / "reference")
