"""Shared fixtures. Integration tests use the real local stack, started exactly as
`make demo` starts it (infra.stack.Stack); `make test` brings it up before pytest."""
from __future__ import annotations

import pytest

from infra.settings import get_settings


@pytest.fixture(scope="session")
def settings():
    return get_settings()


@pytest.fixture(scope="session")
def stack(settings):
    """The running stack; starts missing components (idempotent), fails if one cannot start."""
    from infra.stack import Stack

    st = Stack(settings)
    st.up()
    return st
