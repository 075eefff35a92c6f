"""The stack's replicated Kafka (``SPANRL_KAFKA_BROKERS=3``, issue 21 item 2), three real KRaft
brokers on ports of their own (beside the suite's one-broker stack): topics with replication
factor 3 and min.insync.replicas 2; spanrl's producer (idempotent, acks=all) writes through the
SIGKILL of a broker and of the active controller, and a read_committed reader gets every
record exactly once. The whole pipeline through these faults: ``make chaos`` (kafka_broker,
kafka_controller)."""
from __future__ import annotations

import asyncio
import time

import pytest
from spanrl.core.settings import Settings
from spanrl.infra import chaos
from spanrl.infra.stack import Stack, kafka_node_names
from spanrl.producers.kafka import create_topics, make_producer
from spanrl.schemas import topics as T

pytestmark = [pytest.mark.integration, pytest.mark.slow]


TOPIC = T.Topic("cluster-test", "rollout_id", "span", 3)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    s = Settings(kafka_brokers=3, kafka_port=29092, kafka_controller_port=29093,
                 state_dir=tmp_path_factory.mktemp("kafka-cluster"))
    stack = Stack(s)
    nodes = kafka_node_names(3)
    try:
        stack.up(nodes)  # the last node's after_start creates spanrl's topics with 3 replicas
        yield stack
    finally:
        stack.down(nodes)


async def describe(bootstrap: str, names: list[str]) -> dict[str, list[int]]:
    """topic -> the replica count of each partition, once the broker asked knows every topic
    (a topic just created can be described with an error and no partitions for a while: CI saw
    ``[]`` for spans right after the stack came up)."""
    from aiokafka.admin import AIOKafkaAdminClient

    admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap)
    await admin.start()
    try:
        for _ in range(80):
            topics = await admin.describe_topics(names)
            if all(t["error_code"] == 0 and t["partitions"] for t in topics):
                break
            await asyncio.sleep(0.25)
        else:
            raise AssertionError(f"describe_topics: {[(t['topic'], t['error_code']) for t in topics]}")
        return {t["topic"]: [len(p["replicas"]) for p in t["partitions"]] for t in topics}
    finally:
        await admin.close()


async def min_isr(bootstrap: str, name: str) -> str:
    from aiokafka.admin import AIOKafkaAdminClient
    from aiokafka.admin.config_resource import ConfigResource, ConfigResourceType

    admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap)
    await admin.start()
    try:
        for _ in range(40):  # error 3 (unknown topic) until the new topic reached the broker asked
            (resp,) = await admin.describe_configs([ConfigResource(ConfigResourceType.TOPIC, name)])
            error, _, _, _, entries = resp.resources[0][:5]
            if error == 0:
                return {c[0]: c[1] for c in entries}["min.insync.replicas"]
            await asyncio.sleep(0.25)
        raise AssertionError(f"describe_configs of {name}: error {error}")
    finally:
        await admin.close()


async def produce(bootstrap: str, keys: list[str]) -> None:
    producer = make_producer(bootstrap, request_timeout_ms=30000)
    await producer.start()
    try:
        for k in keys:
            await producer.send_and_wait(TOPIC.name, value=k.encode(), key=k.encode())
    finally:
        await producer.stop()


async def read_all(bootstrap: str) -> list[str]:
    from aiokafka import AIOKafkaConsumer

    consumer = AIOKafkaConsumer(TOPIC.name, bootstrap_servers=bootstrap, auto_offset_reset="earliest",
                                isolation_level="read_committed", enable_auto_commit=False)
    await consumer.start()
    out: list[str] = []
    try:
        idle_until = time.monotonic() + 10
        while time.monotonic() < idle_until:
            batch = await consumer.getmany(timeout_ms=1000)
            for records in batch.values():
                out += [r.value.decode() for r in records]
                idle_until = time.monotonic() + 5
    finally:
        await consumer.stop()
    return out


def test_three_brokers_survive_a_broker_and_the_controller(cluster):
    s = cluster.s
    b = s.kafka_bootstrap
    assert b == "127.0.0.1:29092,127.0.0.1:29192,127.0.0.1:29292"
    replicas = asyncio.run(describe(b, [T.SPANS.name, T.SAMPLES.name]))
    assert replicas[T.SPANS.name] == [3] * T.SPANS.partitions and replicas[T.SAMPLES.name] == [3]
    asyncio.run(create_topics(b, (TOPIC,), s.kafka_replication_factor))
    assert asyncio.run(min_isr(b, TOPIC.name)) == "2"

    asyncio.run(produce(b, [f"a{i}" for i in range(30)]))
    leader = chaos.active_controller(cluster)
    nodes = kafka_node_names(3)
    broker = chaos.cluster_victim("kafka_broker", nodes, leader)
    chaos.kill_component(cluster, broker)  # a broker that is not the controller: its partitions' leaders move
    asyncio.run(produce(b, [f"b{i}" for i in range(30)]))  # 2 of 3 in sync: acks=all still answers
    cluster.start(broker)

    leader = chaos.active_controller(cluster)
    chaos.kill_component(cluster, nodes[leader - 1])  # the active controller (and a broker)
    asyncio.run(produce(b, [f"c{i}" for i in range(30)]))
    new_leader = chaos.active_controller(cluster)
    assert new_leader != leader  # the two remaining voters elected another
    cluster.start(nodes[leader - 1])

    got = asyncio.run(read_all(b))
    want = [f"{p}{i}" for p in "abc" for i in range(30)]
    assert sorted(got) == sorted(want)  # every acknowledged record, none twice
