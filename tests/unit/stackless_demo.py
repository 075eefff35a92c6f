"""``spanrl demo`` in a unit test without a stack: everything up to the main job runs, the main
job is a fake that records what it was given (tests/unit/test_seeding_and_study.py,
test_recipes.py)."""
from __future__ import annotations

import os
from collections.abc import Iterable


def stackless_demo(monkeypatch, seen: dict, env_names: Iterable[str], forget: Iterable[str]) -> None:
    """Patch the CLI so that ``spanrl demo`` starts no stack and its main job records into
    ``seen``: ``cfg`` (the MainJobConfig) and ``env`` (``env_names``' values when it ran).
    ``forget``: variables unset for the test and restored after it (the demo sets some)."""
    import examples.math_agent.main_job as main_job
    from spanrl.infra import cli

    class NoStack:
        def running(self, name: str) -> bool:
            return False

        def down(self) -> None:
            seen["down"] = True

    def fake_main_job(cfg, console=None) -> dict:
        seen["cfg"], seen["env"] = cfg, {k: os.environ.get(k) for k in env_names}
        return {"paths": {}}

    monkeypatch.setattr(cli, "Stack", NoStack)
    monkeypatch.setattr(cli, "_check_free_space", lambda command: None)
    monkeypatch.setattr(cli, "_fresh_run", lambda prefix: NoStack())
    monkeypatch.setattr(cli, "_up_or_exit", lambda stack: None)
    monkeypatch.setattr(main_job, "run_main_job", fake_main_job)
    for k in set(forget):
        monkeypatch.setenv(k, "")  # recorded, so that what the demo sets is undone after the test
        monkeypatch.delenv(k)
