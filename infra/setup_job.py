"""One-shot set-up of a multi-machine deployment: topics (from ``spanrl.schemas.topics``), buckets, schemas.

    python -m spanrl.infra.setup_job --replication-factor 3

Creates every topic of ``topics.ALL`` that is missing, with its declared partition count
(``SPANRL_ROLLOUT_PARTITIONS`` for the rollout-keyed ones) and the given replication
factor, and the checkpoint and payload buckets at ``settings.minio_endpoint``. Idempotent:
run it before the services on every deploy (infra/deploy/compose.yaml ``setup``, the
Kubernetes Job ``spanrl-setup``). It exits 1, creating nothing, when an existing topic has
another partition count than declared: spans, rewards and rollouts are co-partitioned by
rollout_id, and a worker would join records of different rollouts' partitions. With
``SPANRL_SCHEMA_REGISTRY_ADDRESS`` set it registers every schema there too
(spanrl/core/schema_registry.py) and exits 1 when the registry refuses one or assigns ids
other than the committed ones.
"""
from __future__ import annotations

import argparse
import asyncio
import sys
from typing import Mapping

from spanrl.core.settings import Settings, check_environment, get_settings
from spanrl.infra.stack import Stack
from spanrl.schemas import topics as T


def partition_mismatches(declared: Mapping[str, int], existing: Mapping[str, int]) -> list[str]:
    """Topics that exist with another partition count than declared, as
    ``"NAME: N partitions, declared M"`` lines (sorted by name); topics not yet created are fine."""
    return [f"{name}: {existing[name]} partitions, declared {n}" for name, n in sorted(declared.items())
            if name in existing and existing[name] != n]


async def existing_partitions(bootstrap: str) -> dict[str, int]:
    """Partition count of every topic in the cluster (Kafka Metadata API)."""
    from aiokafka import AIOKafkaClient

    client = AIOKafkaClient(bootstrap_servers=bootstrap)
    await client.bootstrap()
    try:
        await client.force_metadata_update()
        md = client.cluster
        return {t: len(md.partitions_for_topic(t) or ()) for t in md.topics()}
    finally:
        await client.close()


async def setup(s: Settings, replication_factor: int) -> list[str]:
    """Create what is missing; returns the partition mismatches (then nothing is created)."""
    from spanrl.producers.kafka import create_topics

    bad = partition_mismatches({t.name: t.partitions for t in T.ALL}, await existing_partitions(s.kafka_bootstrap))
    if bad:
        return bad
    await create_topics(s.kafka_bootstrap, T.ALL, replication_factor)
    Stack(s).create_buckets()  # the local stack's own bucket set-up; starts nothing
    if s.schema_registry_address:
        from spanrl.core import schema_registry

        try:
            wrong = schema_registry.register(s.schema_registry_url, s.schema_compatibility)
        except schema_registry.RegistryError as exc:
            return [str(exc)]
        return [f"schema ids differ from schemas/avro/registry_ids.json: {w}" for w in wrong]
    return []


def main(argv: list[str] | None = None) -> int:
    check_environment()
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--replication-factor", type=int, default=1)
    a = ap.parse_args(argv)
    s = get_settings()
    bad = asyncio.run(setup(s, a.replication_factor))
    if bad:
        print("setup_job: topics exist with another partition count than SPANRL_ROLLOUT_PARTITIONS declares "
              "(co-partitioning by rollout_id would break), or the schema registry refused:\n  " + "\n  ".join(bad),
              file=sys.stderr)
        return 1
    print(f"setup_job: {len(T.ALL)} topics (rollout partitions {T.ROLLOUT_PARTITIONS}, replication "
          f"{a.replication_factor}) and buckets {s.checkpoint_bucket}, {s.payload_bucket} at {s.minio_endpoint} ready")
    return 0


if __name__ == "__main__":
    sys.exit(main())
