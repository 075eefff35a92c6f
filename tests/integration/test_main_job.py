"""A short main job on the real stack: real agent, proxy, bridge, Kafka, Faust, DeepSpeed,
MinIO and vLLM. Asserts on what reached each topic, on the checkpoint manifest, and that
vLLM served a version the trainer produced."""
from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from examples.math_agent.main_job import MainJobConfig, run_main_job
from spanrl.infra.replay import read_topic
from spanrl.schemas import codec
from spanrl.schemas import topics as T
from spanrl.infra.ledger import expected_advantage
from spanrl.trainer import checkpoint

pytestmark = [pytest.mark.integration, pytest.mark.stack_trainer]


@pytest.fixture(scope="module")
def main_job(stack, settings, tmp_path_factory):
    cfg = MainJobConfig(iterations=2, tasks_per_iteration=2, group_size=2, concurrency=4, heldout_tasks=4,
                        ood_tasks=3, stage_timeout_s=420, out_dir=tmp_path_factory.mktemp("results"))
    return run_main_job(cfg, settings)


def test_short_main_job(main_job, settings, tmp_path):
    summary = main_job
    its = summary["iterations"]
    ours = {r for it in its for r in it["rollout_ids"]}

    # every rollout ran and ended; the summary files exist
    assert [it["rollouts"] for it in its] == [4, 4]
    assert Path(summary["paths"]["summary"]).exists() and Path(summary["paths"]["reward_curve"]).stat().st_size > 0
    # held out: base before, the final served version after, on the same 4 tasks, paired
    final = f"{settings.run}:{summary['final_served_version']}"
    assert set(summary["heldout"]) == {"sampled", "greedy"}
    for mode, temperature in (("sampled", None), ("greedy", 0.0)):
        held = summary["heldout"][mode]
        assert list(held["policies"]) == ["base", final] and held["seed"] == 1000
        assert held["temperature"] == temperature
        assert all(p["episodes"] == 4 and p["mean_reward"]["low"] <= p["mean_reward"]["high"]
                   for p in held["policies"].values())
        assert held["paired"][f"{final} - base"]["tasks"] == 4
        assert Path(summary["paths"][f"heldout_{mode}"]).exists()
        assert Path(summary["paths"][f"heldout_{mode}_png"]).stat().st_size > 0
    # out of distribution (gsm_symbolic, never trained on): base and final on the same 3 tasks;
    # held out per task kind: the kinds' episodes add up to the 4 tasks
    for mode in ("sampled", "greedy"):
        ood = summary["ood"][mode]
        assert ood["task_set"] == "gsm_symbolic" and list(ood["policies"]) == ["base", final]
        assert ood["paired"][f"{final} - base"]["tasks"] == 3
        kinds = summary["heldout_per_kind"][mode]
        assert sum(k["base"]["episodes"] for k in kinds.values()) == 4
        assert all(set(k) == {"base", final} for k in kinds.values())
        # the paired final - base per kind covers each kind's tasks once
        paired = summary["heldout_per_kind_paired"][mode]
        assert set(paired) == set(kinds)
        assert sum(p[f"{final} - base"]["tasks"] for p in paired.values()) == 4
    assert summary["seed"] == settings.seed
    # every call is the AutoGen math_agent's, named by AutoGen's telemetry, and trained (no
    # selection in the stack the tests start): calls per agent add up to the transitions
    assert summary["agent"] == "math" and summary["train_agents"] == ["all"]
    assert list(summary["agents"]) == ["math_agent"]
    assert summary["agents"]["math_agent"]["excluded"] == 0
    assert summary["agents"]["math_agent"]["trained"] == sum(it["transitions"] for it in its)
    # this job's records only, and the groups' reward spread is reported
    assert all(it["groups"] == 2 and 0 <= it["zero_variance_groups"] <= 2 for it in its)

    bootstrap = settings.kafka_bootstrap
    spans = [s for s in asyncio.run(read_topic(bootstrap, T.SPANS)) if s["rollout_id"] in ours]
    transitions = [t for t in asyncio.run(read_topic(bootstrap, T.TRANSITIONS)) if t["rollout_id"] in ours]
    samples = [x for x in asyncio.run(read_topic(bootstrap, T.SAMPLES)) if x["transition"]["rollout_id"] in ours]
    dead = [d for d in asyncio.run(read_topic(bootstrap, T.DEAD_LETTER)) if d.get("rollout_id") in ours]

    # spans: one proxy span per LLM call, with vLLM's token ids and one log-prob per token
    calls = {s["span_id"]: s for s in spans if s["source"] == "proxy"}
    assert calls and all(len(c["llm"]["completion_logprobs"]) == len(c["llm"]["completion_token_ids"]) for c in calls.values())
    # transitions: exactly one per recorded call (none lost, none duplicated), token-exact
    keys = [(t["rollout_id"], t["attempt_id"], t["span_id"]) for t in transitions]
    assert len(keys) == len(set(keys))
    dead_spans = {sid for d in dead for sid in calls if sid in d["detail"]}
    assert {t["span_id"] for t in transitions} | dead_spans == set(calls)
    for t in transitions:
        c = calls[t["span_id"]]["llm"]
        assert t["prompt_token_ids"] == c["prompt_token_ids"] and t["completion_token_ids"] == c["completion_token_ids"]
        assert t["reward"] == t["episode_return"]  # identical credit assignment
    # samples: each transition in exactly one group; advantages recomputed from returns
    assert sorted((x["transition"]["rollout_id"], x["transition"]["span_id"]) for x in samples) == \
        sorted((t["rollout_id"], t["span_id"]) for t in transitions)
    by_group: dict[str, dict[str, float]] = {}
    for x in samples:
        by_group.setdefault(x["group_id"], {})[x["transition"]["rollout_id"]] = x["transition"]["episode_return"]
    for x in samples:
        returns = list(by_group[x["group_id"]].values())
        assert x["advantage"] == pytest.approx(expected_advantage(returns, x["transition"]["episode_return"]))

    # the log-prob shift, per iteration, over every one of its completions with an advantage
    # (the policy its update made), and over iteration 0's; the last one is the run's final shift
    for k, it in enumerate(its):
        mine = [x for x in samples if x["transition"]["rollout_id"] in set(it["rollout_ids"])
                and x["transition"]["completion_token_ids"]]
        want = {sign: n for sign, n in (("positive", sum(x["advantage"] > 0 for x in mine)),
                                        ("negative", sum(x["advantage"] < 0 for x in mine))) if n}
        if it["checkpoint_version"] is not None:
            assert {sign: v["completions"] for sign, v in it["logprob_shift_own"].items()} == want
            assert all(v["delta"] == pytest.approx(v["mean_logprob_final"] - v["mean_logprob_behaviour"])
                       for v in it["logprob_shift_own"].values())
        if k == 0:
            assert it["logprob_shift_iteration0"] == it["logprob_shift_own"]
    if its[-1]["checkpoint_version"] is not None:
        assert summary["logprob_shift_of_iteration0_completions"] == its[-1]["logprob_shift_iteration0"]

    # the trainer published a manifest-verified checkpoint that covers the samples ...
    version = max(v for it in its for v in it["checkpoints_announced"])
    dest = tmp_path / settings.run / str(version)
    manifest = checkpoint.download_checkpoint(checkpoint.make_client(settings),
                                              checkpoint.checkpoint_uri(settings.checkpoint_bucket, settings.run, version), dest)
    assert manifest["version"] == version and manifest["trained_offsets"]
    assert set(manifest["files"]) >= {"model.safetensors", "config.json"}
    checkpoint.verify_manifest(dest)
    # the staleness bound: the manifest and the summary report what was trained, by version lag
    assert manifest["staleness"]["max_staleness"] == 4 and manifest["staleness"]["policy"] == "refuse"
    st = summary["staleness"]
    assert st["policy"] == "refuse" and st["kept"] == 0
    assert sum(st["lag_histogram"].values()) + st["refused"] >= len(samples)  # the trainer may train others' too
    assert all(int(lag) >= 0 for lag in st["lag_histogram"])
    # ... and vLLM served it: iteration 1's calls were made by versions no older than
    # iteration 0's, and by a newer one (the trainer may publish while an iteration runs,
    # and earlier tests of the session may have trained this run already)
    assert its[0]["policy_versions_served"] and its[1]["policy_versions_served"]
    assert min(its[1]["policy_versions_served"]) >= max(its[0]["policy_versions_served"])
    assert max(its[1]["policy_versions_served"]) > max(its[0]["policy_versions_served"])
    assert summary["final_served_version"] >= version


def test_replay_with_a_new_credit_rule_then_train(main_job, settings, tmp_path, scratch_run):
    """Replay rebuilds the same transitions from spans/rewards/rollouts into a new topic with
    reward = 0.5 R, leaves the original topic alone, and trains a new run from a checkpoint."""
    import uuid

    from spanrl.infra.replay import ReplayConfig, output_topics, replay

    ours = {r for it in main_job["iterations"] for r in it["rollout_ids"]}
    bootstrap = settings.kafka_bootstrap
    original = [t for t in asyncio.run(read_topic(bootstrap, T.TRANSITIONS)) if t["rollout_id"] in ours]
    n_original_total = len(asyncio.run(read_topic(bootstrap, T.TRANSITIONS)))
    version = max(v for it in main_job["iterations"] for v in it["checkpoints_announced"])
    suffix = f"t{uuid.uuid4().hex[:8]}"
    scratch_run(f"replay-{suffix}")  # the run spanrl.infra.replay trains
    result = replay(ReplayConfig(suffix=suffix, credit_rule="scaled:0.5", train_from=f"{settings.run}:{version}",
                                 train_updates=1, train_max_batch=16, timeout_s=400))
    new_topic = output_topics(suffix)[0]
    replayed = [t for t in asyncio.run(read_topic(bootstrap, new_topic)) if t["rollout_id"] in ours]
    key = lambda t: (t["rollout_id"], t["attempt_id"], t["span_id"])  # noqa: E731
    assert sorted(map(key, replayed)) == sorted(map(key, original))
    by_key = {key(t): t for t in original}
    for t in replayed:
        o = by_key[key(t)]
        assert t["credit_rule"] == "scaled:0.5" and t["reward"] == pytest.approx(0.5 * o["episode_return"])
        assert t["prompt_token_ids"] == o["prompt_token_ids"] and t["completion_token_ids"] == o["completion_token_ids"]
    assert len(asyncio.run(read_topic(bootstrap, T.TRANSITIONS))) == n_original_total  # original untouched
    run = result["training"]["run"]
    dest = tmp_path / run
    manifest = checkpoint.download_checkpoint(checkpoint.make_client(settings),
                                              checkpoint.checkpoint_uri(settings.checkpoint_bucket, run, version + 1), dest)
    assert manifest["parent_version"] == version and manifest["run"] == run
    assert list(manifest["trained_offsets"]) == [f"{output_topics(suffix)[1].name}:0"]


def test_replay_with_the_same_rule_is_byte_identical(main_job, settings):
    """Replaying the stored spans/rewards/rollouts with the rule that made them rebuilds the
    very same transition records, byte for byte (same key, same Avro value)."""
    import uuid

    from spanrl.infra.replay import ReplayConfig, output_topics, read_records, replay

    ours = {r for it in main_job["iterations"] for r in it["rollout_ids"]}
    bootstrap = settings.kafka_bootstrap

    def records(topic: str) -> list[tuple[bytes, bytes]]:
        rows = asyncio.run(read_records(bootstrap, topic))
        return sorted((k, v) for _, _, k, v in rows if codec.decode("transition", v)["rollout_id"] in ours)

    suffix = f"same{uuid.uuid4().hex[:8]}"
    replay(ReplayConfig(suffix=suffix, credit_rule="identical", timeout_s=400))
    original, replayed = records(T.TRANSITIONS.name), records(output_topics(suffix)[0].name)
    assert original and replayed == original
