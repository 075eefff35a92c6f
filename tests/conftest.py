"""Shared fixtures. Integration tests use the real local stack, started exactly as
`make demo` starts it (spanrl.infra.stack.Stack); `make test` brings it up before pytest."""
from __future__ import annotations

import os
import shutil

import pytest

from spanrl.core.settings import get_settings

# The trainers the tests build (and the test stack's, `spanrl test`) run recipe ``plain``, every
# learning option off: the tests check mechanics, each option is tested on its own, and the
# default recipe's values are checked as TrainerConfig's defaults (tests/unit/test_recipes.py)
os.environ.setdefault("SPANRL_RECIPE", "plain")

_REPORTS = pytest.StashKey[dict]()


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    """Tests marked ``stack_trainer`` run first, in their collected order. They ask the test
    stack's trainer (barrier batching) for an update, which trains every sample before the
    offsets they name: run first, an update holds their own samples only; after other tests'
    rollouts it holds those too and takes minutes longer. Only the time depends on the order,
    not the result (a shuffled order, ``-p random_order --random-order``, shuffles after this)."""
    items.sort(key=lambda item: item.get_closest_marker("stack_trainer") is None)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """Keep each phase's report on the test item (for :func:`_drop_tmp_path_once_passed`)."""
    outcome = yield
    report = outcome.get_result()
    item.stash.setdefault(_REPORTS, {})[report.when] = report
    if report.failed and "Timeout (>" in str(report.longrepr):
        report.sections.append(("timeout", timeout_reason(item, report.when)))


def timeout_reason(item, when: str) -> str:
    """What a pytest-timeout failure means: which limit ran out, in which phase, and where
    to look (a hang, not a slow machine, when the limit is far above the test's usual time)."""
    marker = item.get_closest_marker("timeout")
    limit = (f"@pytest.mark.timeout({marker.args[0]})" if marker and marker.args
             else f"the suite's timeout = {item.config.getini('timeout')} s (pyproject.toml)")
    return (f"{item.nodeid} ran out of {limit} during {when}; the thread stacks above show where it "
            f"waited. `make test` prints the 30 slowest tests of each run: a test far below its limit "
            f"there hung here.")


@pytest.fixture(autouse=True)
def _drop_tmp_path_once_passed(request):
    """Delete a test's ``tmp_path`` as soon as it passed. pytest's retention policy "failed"
    (pyproject.toml) removes passed tests' directories only when the session ends, and the
    checkpoints tests download there added ~1.6 GB to the suite's peak disk use."""
    tmp = request.getfixturevalue("tmp_path") if "tmp_path" in request.fixturenames else None
    yield
    call = request.node.stash.get(_REPORTS, {}).get("call")
    if tmp is not None and call is not None and call.passed:
        shutil.rmtree(tmp, ignore_errors=True)


@pytest.fixture(scope="session")
def settings():
    return get_settings()


@pytest.fixture(scope="session")
def stack(settings):
    """The running stack; starts missing components (idempotent), fails if one cannot start."""
    from spanrl.infra.stack import Stack

    st = Stack(settings)
    st.up()
    return st


@pytest.fixture
def scratch_run(settings):
    """``scratch_run(name) -> name``: registers a run a test creates; at the end of the test
    its checkpoints (MinIO objects, the trainer's and reloader's local copies) are deleted,
    so the suite's disk use stays at a few checkpoints (each ~0.5 GB; MinIO refuses writes
    on a nearly full drive). The stack's own run is deleted by ``make test`` at the end."""
    from spanrl.infra import storage
    from spanrl.infra.stack import Stack
    from spanrl.trainer import checkpoint

    made: list[str] = []

    def register(name: str) -> str:
        checkpoint.local_run_dirs(settings.cache_dir, name)  # a valid run name, or ValueError
        storage.register_scratch(settings.cache_dir, name)  # deleted by the next make test if this one dies
        made.append(name)
        return name

    yield register
    if made:
        Stack(settings).up(["minio"])  # a fault test may have stopped it; idempotent
        client = checkpoint.make_client(settings)
        for name in made:
            checkpoint.delete_run(client, settings.checkpoint_bucket, settings.cache_dir, name)
        storage.forget_scratch(settings.cache_dir, made)
