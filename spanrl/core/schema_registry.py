"""spanrl's schemas in a schema registry, over the Confluent Schema Registry REST API
(Confluent docs, "Schema Registry API Reference"; Apicurio Registry serves it under
``/apis/ccompat/v7``).

A record's value names its writer schema by id (spanrl/schemas/codec.py, the Confluent wire
format). The ids are committed (``schemas/avro/registry_ids.json``) so that producers encode
without asking the registry: :func:`register` puts every schema into the registry in id
order - each record type's versions oldest first - under the subject of its Avro full name
(``spanrl.Span``: Confluent's RecordNameStrategy), then under every subject of its topics
(``<topic>-value``: TopicNameStrategy, what kcat and Kafka Connect look up), with the
compatibility rule ``SPANRL_SCHEMA_COMPATIBILITY``, and returns where the registry's id
differs from the committed one. Apicurio Registry (3.3) gives a schema text the same id under
every subject but takes a new number from its id sequence at each registration, even of a
text it holds: only the first pass, one registration per schema on an empty registry, assigns
1, 2, 3, ... - the committed ids. So ids are permanent as long as the registry is spanrl's own
and starts empty or with spanrl's schemas (the stack's keeps them in memory: each start
registers them again and gets the same ids).

:func:`resolver` gives the codec the schema of an id it does not know (a newer writer's);
it asks the registry once per id and answers None when the registry cannot be reached, so a
reader of known ids never depends on the registry being up.
"""
from __future__ import annotations

import logging
from typing import Callable

import httpx

from spanrl.schemas import codec
from spanrl.schemas import topics as T

log = logging.getLogger(__name__)
#: Confluent's content type of the registry API
CONTENT_TYPE = "application/vnd.schemaregistry.v1+json"


class RegistryError(RuntimeError):
    """The registry refused a schema (HTTP status and its message), or could not be reached."""


def subjects(record_type: str, topics: tuple[T.Topic, ...] = T.ALL) -> list[str]:
    """The registry subjects of ``record_type``: its Avro full name (RecordNameStrategy; the
    first: ids are assigned there), then ``<topic>-value`` for each declared topic of it
    (TopicNameStrategy), in table order."""
    return [codec.RECORD_NAMES[record_type]] + [f"{t.name}-value" for t in topics if t.record == record_type]


def registration_order(registry: codec.SchemaRegistry = codec.DEFAULT) -> list[tuple[str, int, int]]:
    """``(record_type, version, committed id)`` of every schema, in id order; ValueError when a
    record type's versions are not in ascending id order (a subject must get them oldest first)
    or an .avsc has no id."""
    rows = sorted(((t, v, i) for (t, v), i in registry.ids.items()), key=lambda r: r[2])
    for record_type in codec.RECORD_NAMES:
        versions = sorted(registry.versions(record_type))
        with_ids = [v for t, v, _ in rows if t == record_type]
        if with_ids != versions:
            raise ValueError(f"{codec.IDS_FILE}: {record_type} versions {versions} have ids in the order {with_ids}")
    return rows


def register(url: str, compatibility: str, registry: codec.SchemaRegistry = codec.DEFAULT,
             client: httpx.Client | None = None) -> list[str]:
    """Set the registry's compatibility rule and register every schema (:func:`registration_order`)
    under each of its :func:`subjects`; idempotent (a schema already there keeps its id).

    Returns ``"<record>.v<N>: registry id X, committed Y"`` lines where they differ (then this
    deployment's producers would write ids the registry gives to other schemas). Raises
    RegistryError for a refusal (409: incompatible with the subject's versions, 422: invalid)
    or an unreachable registry."""
    own = client is None
    client = client or httpx.Client(timeout=30.0)
    headers = {"Content-Type": CONTENT_TYPE}
    try:
        _call(client.put(f"{url}/config", json={"compatibility": compatibility}, headers=headers), "PUT /config")
        wrong = []
        for first in (True, False):  # ids are assigned in the first pass (module docstring)
            for record_type, version, committed in registration_order(registry):
                text = registry.registry_schema(record_type, version)
                names = subjects(record_type)
                for subject in names[:1] if first else names[1:]:
                    got = _call(client.post(f"{url}/subjects/{subject}/versions", json={"schema": text},
                                            headers=headers), f"{record_type} v{version} under {subject}")["id"]
                    if got != committed:
                        wrong.append(f"{record_type}.v{version}: registry id {got}, committed {committed}")
        return sorted(set(wrong))
    except httpx.HTTPError as exc:
        raise RegistryError(f"schema registry at {url}: {type(exc).__name__}: {exc}") from exc
    finally:
        if own:
            client.close()


def _call(response: httpx.Response, what: str) -> dict:
    if response.status_code >= 300:
        raise RegistryError(f"{what}: HTTP {response.status_code} {response.text[:300]}")
    return response.json()


def resolver(url: str, timeout_s: float = 5.0) -> Callable[[int], str | None]:
    """``schema_id -> schema text`` from ``GET {url}/schemas/ids/{id}``; None when the registry
    does not know the id (remembered: a garbage id costs one request) or cannot be reached
    (logged; asked again next time)."""
    unknown: set[int] = set()

    def fetch(schema_id: int) -> str | None:
        if schema_id in unknown:
            return None
        try:
            r = httpx.get(f"{url}/schemas/ids/{schema_id}", timeout=timeout_s)
        except httpx.HTTPError as exc:
            log.warning("schema registry %s unreachable for schema id %d: %s", url, schema_id, exc)
            return None
        if r.status_code == 404:
            unknown.add(schema_id)
        if r.status_code != 200:
            log.warning("schema registry %s: schema id %d: HTTP %d", url, schema_id, r.status_code)
            return None
        return r.json().get("schema")
    return fetch


def install(url: str, registry: codec.SchemaRegistry = codec.DEFAULT) -> None:
    """Let ``registry`` (the codec's default) read records whose schema id it does not know
    from the registry at ``url``."""
    registry.resolver = resolver(url)
