"""The Confluent wire format (magic 0, 4-byte schema id, Avro body: spanrl/schemas/codec.py),
the committed schema ids, the 0x53 framing still read, ids unknown locally resolved once, and
the registry's subjects and schema texts (spanrl/core/schema_registry.py)."""
from __future__ import annotations

import io
import json
import re
from pathlib import Path

import fastavro
import pytest

from spanrl.core import schema_registry
from spanrl.core.settings import Settings
from spanrl.schemas import codec
from spanrl.schemas.codec import SchemaError, SchemaRegistry
from tests.unit.test_schemas import RECORDS, TRANSITION

ROOT = Path(__file__).parents[2]
FIXTURE = ROOT / "tests" / "fixtures" / "archived" / "records.jsonl"
ROWS = [json.loads(line) for line in FIXTURE.read_text().splitlines()]
REWARD = {k: v for k, v in ROWS[1]["decoded"].items() if k != "schema_version"}
#: the Avro body of the fixture's reward v1 (after its 3-byte 0x53 header)
REWARD_BODY = bytes.fromhex(ROWS[1]["value_hex"])[3:]


def test_encode_writes_magic_zero_the_schema_id_and_the_same_avro_body():
    data = codec.encode("reward", REWARD)
    assert data == b"\x00\x00\x00\x00\x03" + REWARD_BODY  # reward v1 is schema id 3
    assert bytes.fromhex(ROWS[1]["value_hex"])[:3] == b"S\x00\x01"  # what the fixture was written with


def test_both_framings_decode_to_the_same_record():
    old, new = bytes.fromhex(ROWS[1]["value_hex"]), codec.encode("reward", REWARD)
    assert codec.decode("reward", old) == codec.decode("reward", new) == ROWS[1]["decoded"]


def test_committed_ids():
    ids = json.loads((codec.AVRO_DIR / codec.IDS_FILE).read_text())
    assert ids == {"span.v1": 1, "span.v2": 2, "reward.v1": 3, "rollout.v1": 4, "rollout.v2": 5, "task.v1": 6,
                   "transition.v1": 7, "transition.v2": 8, "sample.v1": 9, "sample.v2": 10, "checkpoint.v1": 11,
                   "checkpoint.v2": 12, "dead_letter.v1": 13, "call_account.v1": 14, "trace_link.v1": 15}
    # every .avsc has one, and an empty registry assigns 1, 2, ... in registration order
    avsc = {p.name.removesuffix(".avsc") for p in codec.AVRO_DIR.glob("*.avsc")}
    assert set(ids) == avsc and sorted(ids.values()) == list(range(1, len(ids) + 1))
    order = schema_registry.registration_order()
    assert [i for _, _, i in order] == list(range(1, 16)) and order[:2] == [("span", 1, 1), ("span", 2, 2)]


def test_registration_order_refuses_a_newer_version_with_an_older_id(tmp_path):
    for f in codec.AVRO_DIR.glob("*.avsc"):
        (tmp_path / f.name).write_text(f.read_text())
    ids = json.loads((codec.AVRO_DIR / codec.IDS_FILE).read_text())
    (tmp_path / codec.IDS_FILE).write_text(json.dumps({**ids, "span.v1": 2, "span.v2": 1}))
    with pytest.raises(ValueError, match=re.escape("span versions [1, 2] have ids in the order [2, 1]")):
        schema_registry.registration_order(SchemaRegistry(tmp_path))


@pytest.mark.parametrize("text,error", [
    ('{"span.v1": 1, "reward.v1": 1}', "an id is given twice"),
    ('{"span.v1": 0}', "bad entry 'span.v1': 0"),
    ('{"span.v1": true}', "bad entry 'span.v1': True"),
    ('{"span-v1": 1}', "bad entry 'span-v1': 1"),
])
def test_parse_ids_refuses(text, error):
    with pytest.raises(ValueError, match=re.escape(error)):
        codec.parse_ids(text)


def test_a_version_without_an_id_does_not_encode(tmp_path):
    for f in codec.AVRO_DIR.glob("*.avsc"):
        (tmp_path / f.name).write_text(f.read_text())
    v2 = json.loads((tmp_path / "reward.v1.avsc").read_text())
    v2["fields"].append({"name": "grader", "type": "string", "default": ""})
    (tmp_path / "reward.v2.avsc").write_text(json.dumps(v2))
    with pytest.raises(SchemaError, match=re.escape("reward v2 has no schema id in registry_ids.json")):
        SchemaRegistry(tmp_path).encode("reward", REWARD)


@pytest.mark.parametrize("data,detail", [
    (b"", "empty record"),
    (b"\x00\x00\x00\x03", "record shorter than the 5-byte header"),
    (b"\x00\x00\x00\x00\x07" + REWARD_BODY, "schema id 7 is transition v1, not a reward"),
    (b"\x00\x00\x00\x00\x63" + REWARD_BODY, "unknown schema id 99"),
    (b"S\x00", "record shorter than the 3-byte header"),
    (b"S\x00\x02" + REWARD_BODY, "reward has no schema version 2"),
    (b"\x01\x00\x00\x00\x03" + REWARD_BODY, "bad magic byte 0x01"),
    (b"\x00\x00\x00\x00\x03" + REWARD_BODY + b"\x00", "reward v1: trailing bytes after record"),
])
def test_bad_frames_are_schema_errors(data, detail):
    with pytest.raises(SchemaError) as err:
        codec.decode("reward", data)
    assert err.value.reason == "schema_error" and err.value.detail == detail


def _newer_reward() -> str:
    """A reward v2 this checkout does not have (one more field with a default), as a registry holds it."""
    v2 = json.loads((codec.AVRO_DIR / "reward.v1.avsc").read_text())
    v2["fields"][0] = {**v2["fields"][0], "default": 2}
    v2["fields"].append({"name": "grader", "type": "string", "default": ""})
    return json.dumps(v2)


def test_an_unknown_id_is_resolved_once_and_read_into_the_newest_local_version():
    asked = []
    registry = SchemaRegistry(resolver=lambda i: asked.append(i) or (_newer_reward() if i == 16 else None))
    buf = io.BytesIO()
    fastavro.schemaless_writer(buf, fastavro.parse_schema(json.loads(_newer_reward()), named_schemas={}),
                               {**REWARD, "schema_version": 2, "grader": "strict"})
    data = b"\x00\x00\x00\x00\x10" + buf.getvalue()
    for _ in range(2):
        assert registry.decode("reward", data) == {**REWARD, "schema_version": 2}  # grader dropped: not in v1
    assert asked == [16]
    with pytest.raises(SchemaError, match="schema id 16 is spanrl.Reward, not a span"):
        registry.decode("span", data)
    with pytest.raises(SchemaError, match="unknown schema id 17"):
        registry.decode("reward", b"\x00\x00\x00\x00\x11" + buf.getvalue())


def test_a_resolved_text_that_is_not_avro_is_a_schema_error():
    registry = SchemaRegistry(resolver=lambda i: '{"type": "string"}')
    with pytest.raises(SchemaError, match="schema id 16: not an Avro record schema"):
        registry.decode("reward", b"\x00\x00\x00\x00\x10\x00")


def test_encode_around_keeps_the_new_framing():
    """A sample around an encoded transition: the sample's id (10), the transition's body as
    encoded (id 8), byte for byte what encode writes; a transition in the 0x53 framing is not
    spliced (None: the caller decodes it)."""
    sample = {k: v for k, v in RECORDS["sample"].items() if k != "transition"}
    transition = codec.encode("transition", TRANSITION)
    assert transition[:5] == b"\x00\x00\x00\x00\x08"
    spliced = codec.encode_around("sample", sample, "transition", transition)
    assert spliced[:5] == b"\x00\x00\x00\x00\x0a"
    assert spliced == codec.encode("sample", {**sample, "transition": codec.decode("transition", transition)})
    assert codec.encode_around("sample", sample, "transition", b"S\x00\x02" + transition[5:]) is None


def test_registry_schema_inlines_what_a_version_embeds():
    text = codec.DEFAULT.registry_schema("sample", 1)
    raw = json.loads(text)
    transition = next(f["type"] for f in raw["fields"] if f["name"] == "transition")
    assert transition == json.loads((codec.AVRO_DIR / "transition.v1.avsc").read_text())
    fastavro.parse_schema(raw, named_schemas={})  # parses alone, as a registry's reader does
    assert json.loads(codec.DEFAULT.registry_schema("reward", 1)) == json.loads(
        (codec.AVRO_DIR / "reward.v1.avsc").read_text())


def test_inline_schema_replaces_the_first_use_only():
    inner = {"type": "record", "name": "I", "namespace": "n", "fields": [{"name": "x", "type": "int"}]}
    outer = {"type": "record", "name": "O", "fields": [{"name": "a", "type": "n.I"},
                                                       {"name": "b", "type": ["null", "n.I"], "default": None}]}
    assert codec.inline_schema(outer, {"n.I": inner}) == {
        "type": "record", "name": "O", "fields": [{"name": "a", "type": inner},
                                                  {"name": "b", "type": ["null", "n.I"], "default": None}]}


def test_subjects():
    assert schema_registry.subjects("span") == ["spanrl.Span", "spans-value", "orphan-spans-value", "spans.eval-value"]
    assert schema_registry.subjects("transition") == ["spanrl.Transition", "transitions-value"]
    assert schema_registry.subjects("trace_link") == ["spanrl.TraceLink"]


def test_registry_url_and_bootstrap_version():
    assert Settings.from_environ({}).schema_registry_url == "http://127.0.0.1:18081/apis/ccompat/v7"
    assert Settings.from_environ({"SPANRL_SCHEMA_REGISTRY_ADDRESS": "http://reg:8080/apis/ccompat/v7/"}
                                 ).schema_registry_url == "http://reg:8080/apis/ccompat/v7"
    boot = (ROOT / "infra" / "bootstrap.sh").read_text()
    assert f'registry_version="${{SPANRL_SCHEMA_REGISTRY_VERSION:-{Settings().schema_registry_version}}}"' in boot


def test_stack_component(tmp_path):
    from spanrl.infra.stack import Stack

    st = Stack(Settings(state_dir=tmp_path, cache_dir=tmp_path / "cache"))
    comp = st.components["schema-registry"]
    assert comp.command == [str(tmp_path / "cache" / "apicurio-registry-3.3.3" / "java"), "-Xms256m", "-Xmx512m",
                            "-Dquarkus.http.host=127.0.0.1", "-Dquarkus.http.port=18081",
                            "-Dquarkus.management.host=127.0.0.1", "-Dquarkus.management.port=18082",
                            "-jar", str(tmp_path / "cache" / "apicurio-registry-3.3.3" / "quarkus-run.jar")]
    assert comp.after_start == st.register_schemas
    assert list(st.components).index("schema-registry") < list(st.components).index("bridge")
    from spanrl.infra.stack import StackError
    with pytest.raises(StackError, match="run `make bootstrap`"):
        comp.prepare()


def test_an_unreachable_registry_resolves_nothing_and_refuses_registration():
    """Readers of known ids never need the registry; an unknown id read while it is down is a
    schema error (dead letter), and the stack's registration step says where it failed."""
    registry = SchemaRegistry()
    schema_registry.install("http://127.0.0.1:1", registry)  # nothing listens on port 1
    assert registry.decode("reward", codec.encode("reward", REWARD)) == {**REWARD, "schema_version": 1}
    with pytest.raises(SchemaError, match="unknown schema id 99"):
        registry.decode("reward", b"\x00\x00\x00\x00\x63" + REWARD_BODY)
    with pytest.raises(schema_registry.RegistryError, match=re.escape("schema registry at http://127.0.0.1:1: Connect")):
        schema_registry.register("http://127.0.0.1:1", "BACKWARD")


def test_the_resolver_asks_a_registry_once_per_id():
    """A registry over HTTP (a local server with the Confluent API's ``/schemas/ids/{id}``): a
    newer writer's id is fetched once and read; an id it answers 404 for is asked once."""
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    asked: list[str] = []

    class Registry(BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802 (http.server's name)
            asked.append(self.path)
            found = self.path == "/schemas/ids/16"
            body = json.dumps({"schema": _newer_reward()} if found else {"error_code": 40403}).encode()
            self.send_response(200 if found else 404)
            self.send_header("Content-Type", "application/vnd.schemaregistry.v1+json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Registry)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        registry = SchemaRegistry()
        schema_registry.install(f"http://127.0.0.1:{server.server_port}", registry)
        buf = io.BytesIO()
        fastavro.schemaless_writer(buf, fastavro.parse_schema(json.loads(_newer_reward()), named_schemas={}),
                                   {**REWARD, "schema_version": 2, "grader": "g"})
        for _ in range(2):
            assert registry.decode("reward", b"\x00\x00\x00\x00\x10" + buf.getvalue()) == {**REWARD, "schema_version": 2}
            with pytest.raises(SchemaError, match="unknown schema id 17"):
                registry.decode("reward", b"\x00\x00\x00\x00\x11" + buf.getvalue())
        assert asked == ["/schemas/ids/16", "/schemas/ids/17"]
    finally:
        server.shutdown()


def test_the_wheel_carries_the_schema_ids():
    """An installed client's codec reads ``avro/registry_ids.json`` at import: the wheel's
    package data names it beside the .avsc files."""
    import fnmatch
    import tomllib

    globs = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]["spanrl.schemas"]
    needed = [f"avro/{p.name}" for p in codec.AVRO_DIR.iterdir() if p.suffix in (".avsc", ".json")]
    assert "avro/registry_ids.json" in needed
    assert [n for n in needed if not any(fnmatch.fnmatch(n, g) for g in globs)] == []
