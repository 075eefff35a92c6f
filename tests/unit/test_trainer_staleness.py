"""The staleness bound (trainer/staleness.py) and the trainer's intake of stale samples."""
import asyncio

import pytest

from spanrl.trainer import staleness
from spanrl.trainer.staleness import StalenessRule


def test_lag_and_verdicts():
    assert staleness.version_lag(7, 3) == 4 and staleness.version_lag(0, 0) == 0 and staleness.version_lag(2, 5) == -3
    rule = StalenessRule(4, "refuse")
    assert [staleness.judge(lag, rule) for lag in (-3, 0, 4, 5, 40)] == ["train", "train", "train", "refused", "refused"]
    keep = StalenessRule(1, "keep")
    assert [staleness.judge(lag, keep) for lag in (0, 1, 2)] == ["train", "train", "kept"]
    assert staleness.judge(10**6, StalenessRule(-1, "refuse")) == "train"  # no bound
    assert StalenessRule() == StalenessRule(4, "refuse")  # the default (TRL's max_staleness)
    with pytest.raises(ValueError, match="stale_policy must be one of refuse, keep"):
        StalenessRule(4, "drop")


def test_lag_histograms():
    assert staleness.lag_histogram([1, 0, 1, 3]) == {"0": 1, "1": 2, "3": 1}
    assert list(staleness.lag_histogram([10, -1, 2])) == ["-1", "2", "10"]  # in lag order, not text order
    assert staleness.lag_histogram([]) == {}
    assert staleness.add_histograms({"0": 1, "2": 1}, {"2": 3, "10": 1}, {}) == {"0": 1, "2": 4, "10": 1}
    assert staleness.subtract_histograms({"0": 3, "1": 2}, {"0": 1, "1": 2}) == {"0": 2}
    with pytest.raises(ValueError, match="went down at lag 1"):
        staleness.subtract_histograms({"1": 1}, {"1": 2})


def _sample(i: int, version: int) -> dict:
    return {"transition": {"rollout_id": f"r{i}", "task_id": "t", "span_id": f"s{i}", "policy_version": version,
                           "prompt_token_ids": [1], "completion_token_ids": [2], "behaviour_logprobs": [-1.0]},
            "advantage": 1.0}


def _trainer(monkeypatch, tmp_path, **cfg):
    from spanrl.trainer import train

    monkeypatch.setattr(train.checkpoint, "make_client", lambda settings: None)
    t = train.Trainer(train.TrainerConfig(run="unit", http=False, log_path=tmp_path / "t.jsonl", **cfg))
    refused = []

    async def send(rollout_id, record):  # only Kafka's part is faked (the integration test's)
        lag = int(record["detail"].split()[1])
        assert record["reason"] == "stale_sample" and record["stage"] == "trainer"
        refused.append((record["source_partition"], record["source_offset"], lag))

    monkeypatch.setattr(t, "_send_dead_letter", send)
    return t, refused


def test_intake_refuses_samples_beyond_the_bound(monkeypatch, tmp_path):
    """Trained version 6, max_staleness 4: behaviour versions 6, 2, 1, 5 -> lags 0, 4, 5, 1;
    the lag-5 sample is refused (dead letter with its offset and lag), a bad one is skipped."""
    t, refused = _trainer(monkeypatch, tmp_path)
    t.state.version = 6
    head = [(0, 10, _sample(0, 6)), (0, 11, _sample(1, 2)), (0, 12, None), (0, 13, _sample(3, 1)),
            (0, 14, _sample(4, 5))]
    train, lags, kept = asyncio.run(t._bound_staleness(head))
    assert [s["transition"]["span_id"] for s in train] == ["s0", "s1", "s4"]
    assert (lags, kept, refused) == ([0, 4, 1], 0, [(0, 13, 5)])
    assert t.state.staleness == {"max_staleness": 4, "policy": "refuse", "lag_histogram": {}, "refused": 1, "kept": 0}


def test_intake_keeps_stale_samples_by_setting(monkeypatch, tmp_path):
    t, refused = _trainer(monkeypatch, tmp_path, max_staleness=1, stale_policy="keep")
    t.state.version = 3
    train, lags, kept = asyncio.run(t._bound_staleness([(0, 0, _sample(0, 3)), (0, 1, _sample(1, 0))]))
    assert (len(train), lags, kept, refused) == (2, [0, 3], 1, [])


def test_bad_stale_policy_is_refused_at_start(monkeypatch, tmp_path):
    with pytest.raises(ValueError, match="stale_policy"):
        _trainer(monkeypatch, tmp_path, stale_policy="sometimes")


def test_status_delta_is_what_the_job_trained():
    before = {"max_staleness": 4, "policy": "refuse", "lag_histogram": {"0": 2}, "refused": 0, "kept": 0}
    after = {"max_staleness": 4, "policy": "refuse", "lag_histogram": {"0": 5, "1": 1}, "refused": 2, "kept": 0}
    assert staleness.status_delta(before, after) == {"max_staleness": 4, "policy": "refuse",
                                                     "lag_histogram": {"0": 3, "1": 1}, "refused": 2, "kept": 0}
    assert staleness.status_delta(None, after)["lag_histogram"] == {"0": 5, "1": 1}
    assert staleness.status_delta(before, None) is None


def test_reinforce_pp_normalises_the_credited_reward_grpo_keeps_the_group_advantage():
    """With AIR, calls of one rollout differ in ``reward`` (R + i_t) though R is the same:
    reinforce_pp sees the difference, grpo uses the stream job's advantage of R."""
    from spanrl.trainer.train import sample_advantages

    smp = [{"transition": {"reward": r, "episode_return": 1.0 if i < 2 else 0.0}, "advantage": a}
           for i, (r, a) in enumerate([(0.75, 1.0), (1.05, 1.0), (0.0, -1.0), (0.0, -1.0)])]
    mean = 0.45
    std = ((0.3 ** 2 + 0.6 ** 2 + 2 * 0.45 ** 2) / 4) ** 0.5
    assert sample_advantages(smp, "reinforce_pp") == pytest.approx([(r - mean) / (std + 1e-6)
                                                                     for r in (0.75, 1.05, 0.0, 0.0)], abs=1e-6)
    assert sample_advantages(smp, "grpo") == [1.0, 1.0, -1.0, -1.0]
    with pytest.raises(ValueError, match="unknown algorithm"):
        sample_advantages(smp, "ppo")


def test_fetch_limit_holds_one_update_in_stream_batching():
    from spanrl.trainer.train import fetch_limit

    assert fetch_limit("stream", 0, 16, 64) == 64            # an empty buffer: one update's worth
    assert fetch_limit("stream", 40, 16, 64) == 24
    assert fetch_limit("stream", 64, 16, 64) == 0            # full: train before reading more
    assert fetch_limit("stream", 70, 16, 64) == 0
    assert fetch_limit("stream", 0, 512, 64) == 512          # min_batch above max_batch: it can still start
    assert fetch_limit("stream", 0, 16, 5000) == 1000        # never more than one fetch's worth
    assert fetch_limit("barrier", 5000, 16, 64) == 1000      # barrier: read on to the requested offsets
