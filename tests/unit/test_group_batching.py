"""``groups`` batching (trainer/batching.py ``group_cut``): an update is cut by a count of
complete GRPO groups, each group's samples in one update, from the samples and their order
alone (no driver, no clock)."""
from __future__ import annotations

import pytest

from spanrl.trainer.batching import group_cut


def sample(group: str, rollout: str, calls: int = 1, rollouts: int = 1) -> dict:
    """A Sample of ``group`` from ``rollout`` (which has ``calls`` samples; the group ``rollouts``)."""
    return {"group_id": group, "group_rollouts": rollouts,
            "transition": {"rollout_id": rollout, "rollout_transition_count": calls}}


A1, A2 = sample("a", "ra", calls=2), sample("a", "ra", calls=2)
B1, B2 = sample("b", "rb", calls=2), sample("b", "rb", calls=2)
C1 = sample("c", "rc")


def test_the_docstrings_example():
    buffer = [A1, A2, B1, C1, B2]
    assert group_cut(buffer, 1) == 2       # a complete
    assert group_cut(buffer, 2) == 5       # a and c complete at 4, but b is open there
    assert group_cut(buffer, 3) == 5
    assert group_cut(buffer[:4], 3) is None
    assert group_cut(buffer, 4) is None    # three groups in all: read more


def test_a_group_is_complete_with_all_its_rollouts_and_all_their_calls():
    r1a, r1b = sample("g", "r1", calls=2, rollouts=2), sample("g", "r1", calls=2, rollouts=2)
    r2 = sample("g", "r2", calls=1, rollouts=2)
    assert group_cut([r1a, r2], 1) is None            # r1 has one of its two calls
    assert group_cut([r1a], 1) is None
    assert group_cut([r1a, r2, r1b], 1) == 3
    assert group_cut([r1a, r1b], 1) is None           # one rollout of two
    assert group_cut([r1a, r1b, r2, C1], 1) == 3      # c stays for the next update


def test_undecodable_entries_go_with_the_prefix_they_lie_in():
    assert group_cut([None, C1, None], 1) == 2
    assert group_cut([None, None], 1) is None


def test_a_stalled_group_holds_updates_back_only_until_stalled_after_groups_complete():
    stuck = sample("s", "rs", calls=1, rollouts=2)  # its other rollout was dead-lettered
    d, e = sample("d", "rd"), sample("e", "re")
    buffer = [stuck, B1, B2, C1, d, e]
    assert group_cut(buffer[:5], 2) is None         # b and c complete, s open: wait (3 complete < 4)
    assert group_cut(buffer, 2) == 4                # 4 complete: the shortest prefix with 2 (s's sample in it)
    assert group_cut(buffer, 2, stalled_after=3) == 4
    assert group_cut(buffer[:5], 2, stalled_after=3) == 4


def test_a_late_member_with_its_group_completes_it():
    first = sample("a", "r1", rollouts=1)
    late = sample("a", "r2", rollouts=2)  # a short group's late member: group_rollouts counts it
    assert group_cut([first, late, C1], 1) == 1  # a is complete at its first sample already
    assert group_cut([late, B1, B2, C1], 1, stalled_after=2) == 3  # alone: stalled until 2 others complete


def test_groups_must_be_positive():
    with pytest.raises(ValueError, match="groups per update must be >= 1"):
        group_cut([C1], 0)


def test_the_trainer_knows_the_mode_and_reads_on_in_it():
    from spanrl.core.settings import TrainerConfig
    from spanrl.trainer.train import BATCHING_MODES, fetch_limit

    assert BATCHING_MODES == ("stream", "barrier", "groups")
    assert fetch_limit("groups", 5000, 16, 64) == 1000  # the buffer must reach the end of the groups
    cfg = TrainerConfig.from_environ({"SPANRL_TRAINER_BATCHING": "groups", "SPANRL_TRAINER_UPDATE_GROUPS": "4"})
    assert (cfg.batching, cfg.update_groups) == ("groups", 4)
    assert TrainerConfig.from_environ({}).batching == "groups"  # the default (recipe default): no driver needed


@pytest.mark.parametrize("mode,status", [("groups", 202), ("barrier", 202), ("stream", 409)])
def test_a_driver_may_ask_a_groups_trainer_for_an_update(monkeypatch, tmp_path, mode, status):
    """``POST /admin/train`` works in groups batching too (the main job drives a stack that
    ``make up`` started with the default recipe); a stream trainer refuses it (409 not_barrier)."""
    import asyncio

    from spanrl.trainer import train

    monkeypatch.setattr(train.checkpoint, "make_client", lambda settings: None)
    t = train.Trainer(train.TrainerConfig(run="unit", http=False, log_path=tmp_path / "t.jsonl", batching=mode))
    code, body = asyncio.run(t.request_train({"until": {f"{t.cfg.samples_topic}:0": 12}}))
    assert code == status
    assert t._train_until == ({0: 12} if status == 202 else {})
    assert train.DRIVEN_BATCHING == ("barrier", "groups")
