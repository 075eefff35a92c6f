"""The stack's replicated Kafka (``SPANRL_KAFKA_BROKERS``, issue 21 item 2): settings, the
nodes' properties, the chaos faults' choice of broker and their order. The cluster itself runs
in tests/integration/test_kafka_cluster.py."""
from __future__ import annotations

from pathlib import Path

import pytest
from pydantic import ValidationError
from spanrl.core.settings import Settings
from spanrl.infra import chaos
from spanrl.infra.stack import kafka_node_names, kafka_server_properties
from spanrl.producers.kafka import check_created


def test_brokers_setting_ports_and_bootstrap():
    one = Settings()
    assert one.kafka_brokers == 1 and one.kafka_replication_factor == 1
    assert one.kafka_bootstrap == "127.0.0.1:19092"
    three = Settings(kafka_brokers=3, kafka_port=29092, kafka_controller_port=29093)
    assert three.kafka_ports == [29092, 29192, 29292]
    assert three.kafka_controller_ports == [29093, 29193, 29293]
    assert three.kafka_bootstrap == "127.0.0.1:29092,127.0.0.1:29192,127.0.0.1:29292"
    assert three.kafka_replication_factor == 3
    assert Settings(kafka_brokers=3, kafka_bootstrap_servers="k:9092").kafka_bootstrap == "k:9092"
    for bad in (0, 2):
        with pytest.raises(ValidationError, match="must be 1, or >= 3"):
            Settings(kafka_brokers=bad)


def test_node_names():
    assert kafka_node_names(1) == ["kafka"]
    assert kafka_node_names(3) == ["kafka", "kafka2", "kafka3"]


def props(text: str) -> dict[str, str]:
    return dict(line.split("=", 1) for line in text.splitlines() if line)


def test_server_properties_of_one_broker_and_of_a_cluster():
    one = props(kafka_server_properties(1, "127.0.0.1", [19092], [19093], Path("/d")))
    assert one["controller.quorum.voters"] == "1@127.0.0.1:19093"
    assert one["listeners"] == "PLAINTEXT://127.0.0.1:19092,CONTROLLER://127.0.0.1:19093"
    assert (one["default.replication.factor"], one["min.insync.replicas"], one["offsets.topic.replication.factor"],
            one["transaction.state.log.replication.factor"], one["transaction.state.log.min.isr"]) == \
        ("1", "1", "1", "1", "1")
    second = props(kafka_server_properties(2, "127.0.0.1", [1, 2, 3], [11, 12, 13], Path("/d2")))
    assert second["node.id"] == "2"
    assert second["controller.quorum.voters"] == "1@127.0.0.1:11,2@127.0.0.1:12,3@127.0.0.1:13"
    assert second["listeners"] == "PLAINTEXT://127.0.0.1:2,CONTROLLER://127.0.0.1:12"
    assert second["advertised.listeners"] == "PLAINTEXT://127.0.0.1:2"
    assert second["log.dirs"] == "/d2"
    assert (second["default.replication.factor"], second["min.insync.replicas"],
            second["offsets.topic.replication.factor"], second["transaction.state.log.replication.factor"],
            second["transaction.state.log.min.isr"]) == ("3", "2", "3", "3", "2")


def test_quorum_leader_from_describe_status():
    text = ("ClusterId:              abc\nLeaderId:               2\nLeaderEpoch:            5\n"
            "HighWatermark:          120\nCurrentVoters:          [{\"id\": 1}, {\"id\": 2}, {\"id\": 3}]\n")
    assert chaos.quorum_leader(text) == 2
    with pytest.raises(ValueError, match="no LeaderId"):
        chaos.quorum_leader("LeaderId: -1\n")  # no leader elected
    with pytest.raises(ValueError, match="no LeaderId"):
        chaos.quorum_leader("Connection refused")


def test_cluster_victim():
    nodes = ["kafka", "kafka2", "kafka3"]
    assert chaos.cluster_victim("kafka_controller", nodes, 2) == "kafka2"
    assert chaos.cluster_victim("kafka_broker", nodes, 2) == "kafka3"
    assert chaos.cluster_victim("kafka_broker", nodes, 3) == "kafka2"
    assert chaos.cluster_victim("stream_replica", nodes, 1, ["stream", "stream2"]) == "stream2"
    with pytest.raises(ValueError, match="two stream workers"):
        chaos.cluster_victim("stream_replica", nodes, 1, ["stream"])
    with pytest.raises(ValueError, match="not a cluster fault"):
        chaos.cluster_victim("kafka", nodes, 1)


def test_chaos_phases():
    every = tuple(chaos.FAULTS)
    assert chaos.CLUSTER_FAULTS == ("kafka_broker", "kafka_controller", "stream_replica")
    assert chaos.chaos_phases(every, False) == [(False, tuple(f for f in every if f not in chaos.CLUSTER_FAULTS)),
                                               (True, chaos.CLUSTER_FAULTS)]
    assert chaos.chaos_phases(("worker",), False) == [(False, ("worker",))]
    assert chaos.chaos_phases(("kafka_controller",), False) == [(True, ("kafka_controller",))]
    assert chaos.chaos_phases(every, True) == [(True, every)]


def test_cluster_layout():
    from spanrl.core.settings import CLUSTER_LAYOUT

    assert not chaos.is_cluster(Settings())
    assert not chaos.is_cluster(Settings(kafka_brokers=3))  # brokers alone are not the layout
    assert chaos.is_cluster(Settings(**CLUSTER_LAYOUT))
    assert chaos.is_cluster(Settings(kafka_brokers=5, stream_workers=3, bridge_replicas=2))

def test_check_created_raises_what_kafka_refused():
    from aiokafka.errors import InvalidReplicationFactorError

    check_created([("a", 0, None), ("b", 36, "Topic 'b' already exists.")])
    with pytest.raises(InvalidReplicationFactorError, match="topic c: Replication factor: 3 larger"):
        check_created([("a", 0, None), ("c", 38, "Replication factor: 3 larger than available brokers: 1.")])
    with pytest.raises(InvalidReplicationFactorError, match="topic c: refused"):
        check_created([("c", 38)])  # v0 responses carry no message


def test_kafka_stands_for_every_node(tmp_path):
    from spanrl.infra.stack import Stack

    three = Stack(Settings(kafka_brokers=3, state_dir=tmp_path))
    assert three.with_replicas(["kafka", "minio"]) == ["kafka", "kafka2", "kafka3", "minio"]
    assert three.with_replicas(["minio", "kafka2"]) == ["minio", "kafka2"]
    assert list(three.components)[:4] == ["kafka", "kafka2", "kafka3", "minio"]
    assert three.components["kafka2"].peers == ("kafka", "kafka3")
    assert three.components["kafka3"].after_start == three.create_topics
    assert three.components["kafka"].after_start is None
    assert Stack(Settings(state_dir=tmp_path)).with_replicas(["kafka", "minio"]) == ["kafka", "minio"]


def test_default_replication():
    from spanrl.core.settings import default_replication

    assert [default_replication(n) for n in (1, 2, 3, 5)] == [1, 1, 3, 3]


def test_replica_ports_and_validation():
    s = Settings(stream_workers=2, bridge_replicas=3)
    assert s.faust_web_ports == [16066, 16166]
    assert s.bridge_ports == [14318, 14418, 14518] and s.bridge_grpc_ports == [14317, 14417, 14517]
    assert s.bridge_urls == ["http://127.0.0.1:14318", "http://127.0.0.1:14418", "http://127.0.0.1:14518"]
    assert s.bridge_urls[0] == s.bridge_url
    assert Settings(bridge_replicas=2, bridge_grpc_port=0).bridge_grpc_ports == [0, 0]  # gRPC off on every bridge
    assert Settings().faust_web_ports == [16066] and Settings().bridge_ports == [14318]
    for field in ("stream_workers", "bridge_replicas"):
        with pytest.raises(ValidationError, match="at least 1"):
            Settings(**{field: 0})


def test_cluster_stack_components(tmp_path):
    from spanrl.core.settings import CLUSTER_LAYOUT
    from spanrl.infra.stack import Stack, replica_names

    st = Stack(Settings(state_dir=tmp_path, **CLUSTER_LAYOUT))
    assert list(st.components) == ["kafka", "kafka2", "kafka3", "minio", "schema-registry", "vllm", "bridge", "bridge2", "proxy",
                                   "stream", "stream2", "trainer", "reloader", "dashboard"]
    assert replica_names("stream", 1) == ["stream"]
    assert st.with_replicas(["stream", "bridge"]) == ["stream", "stream2", "bridge", "bridge2"]
    assert st.with_replicas(["stream2"]) == ["stream2"]
    b2, w2 = st.components["bridge2"].command, st.components["stream2"].command
    assert b2[b2.index("--port") + 1] == "14418" and b2[b2.index("--grpc-port") + 1] == "14417"
    assert w2[w2.index("--web-port") + 1] == "16166"
    # each worker keeps its Faust data directory apart (``--datadir`` before the subcommand)
    assert w2[w2.index("--datadir") + 1] == str(tmp_path / "stream" / "stream2") and w2.index("--datadir") < w2.index("worker")
    assert {n for n, *_ in st.status()} == set(st.components)


def test_down_stops_what_another_layout_started(tmp_path):
    import subprocess

    from spanrl.infra.stack import Stack

    one = Stack(Settings(state_dir=tmp_path))
    assert one.strays() == []
    one.pids.mkdir(parents=True)
    proc = subprocess.Popen(["sleep", "60"], start_new_session=True)
    (one.pids / "stream2.pid").write_text(str(proc.pid))  # as `stack up --cluster` left it
    (one.pids / "kafka.pid").write_text("999999999")  # in this layout: not a stray
    assert one.strays() == ["stream2"]
    one.down()
    assert proc.wait(timeout=20) is not None and one.strays() == []


def test_bridge_for_spreads_rollouts_stably():
    import zlib

    from spanrl.infra.chaos_workload import bridge_for

    urls = ["http://127.0.0.1:14318", "http://127.0.0.1:14418"]
    rids = [f"r{i}" for i in range(200)]
    picks = [bridge_for(r, urls) for r in rids]
    assert picks == [urls[zlib.crc32(r.encode()) % 2] for r in rids] == [bridge_for(r, urls) for r in rids]
    assert 70 < picks.count(urls[0]) < 130  # both take a share
    assert bridge_for("r1", urls[:1]) == urls[0]
    with pytest.raises(ValueError, match="no bridge"):
        bridge_for("r1", [])
