"""The worker's tables read back on recovery what they write (stream_jobs/app.py)."""
from faust.serializers import codecs

from spanrl.schemas import codec
from spanrl.stream_jobs.app import StreamConfig, make_app

TRANSITION = {"rollout_id": "r", "attempt_id": "0", "span_id": "s", "task_id": "t", "group_size": 4,
              "sequence_id": 1, "call_index": 0, "rollout_transition_count": 1, "agent_name": None,
              "model": "m", "policy_version": 0, "prompt_token_ids": [1, 2], "completion_token_ids": [3],
              "behaviour_logprobs": [-0.5], "episode_return": 1.0, "reward": 1.0, "credit_rule": "identical",
              "status": "succeeded"}


def test_every_changelog_is_read_with_the_serializer_it_is_written_with():
    """Recovery decodes with the changelog topic's serializer (cloned for the recovery
    consumer), writes use the table's: they must agree (app._use_value_serializer)."""
    app = make_app(StreamConfig(app_id="unit-tables"))
    seen = {}
    for name, table in app.tables.items():
        recovery_side = table.changelog_topic.clone()
        assert recovery_side.value_serializer == table.value_serializer, name
        seen[name] = table.value_serializer
    assert seen["group-transitions"] == "spanrl_transition"
    written = codecs.dumps(seen["group-transitions"], TRANSITION)
    assert written[:1] == bytes([codec.MAGIC])  # Avro, a third of the JSON
    back = codecs.loads(app.tables["group-transitions"].changelog_topic.value_serializer, written)
    assert {k: back[k] for k in TRANSITION} == TRANSITION
