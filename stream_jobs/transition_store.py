"""The grouper's in-memory store of waiting transitions (stream_jobs/agent_group.py), and
samples encoded around the stored transition records.

Why in memory and not a table (issue 11): a changelogged table of transitions was the
largest share of the worker's produce traffic (a 2.4 KB record and a tombstone per
transition) for data that Kafka already holds on ``transitions``; a worker that restores a
group state without them re-reads them from there (``grouping.missing_reads``).
"""
from __future__ import annotations

from collections.abc import Mapping, MutableMapping

from spanrl.schemas import codec


class StoredTransition(Mapping):
    """A waiting transition as the grouper's store holds it: its Avro record (``record``,
    schemas/avro/transition.v2.avsc: ~2.4 KB for 512 + 128 tokens, where the decoded dict
    takes ~10x that in memory) and its fields other than the token arrays; the arrays are
    decoded only if something reads them. The grouper reads ids, counts and returns; a
    sample is then encoded around ``record`` (codec.encode_around) and a dead letter carries
    it as its payload, so the arrays are never decoded again."""

    ARRAYS = frozenset({"prompt_token_ids", "completion_token_ids", "behaviour_logprobs"})
    __slots__ = ("record", "_small", "_full")

    def __init__(self, record: bytes, transition: dict):
        self.record = record
        self._small = {k: v for k, v in transition.items() if k not in self.ARRAYS}
        self._full: dict | None = None

    def _decoded(self) -> dict:
        if self._full is None:
            self._full = codec.decode("transition", self.record)
        return self._full

    def __getitem__(self, key: str):
        return self._small[key] if key in self._small else self._decoded()[key]

    def __iter__(self):
        return iter(self._decoded())

    def __len__(self) -> int:
        return len(self._decoded())


class TransitionStore(MutableMapping):
    """The grouper's store of waiting transitions (stream_jobs/grouping.py): key ->
    :class:`StoredTransition`, in memory."""

    def __init__(self):
        self.records: dict[str, StoredTransition] = {}
        self._source: tuple[dict, bytes] | None = None

    def put_record(self, key: str, value: bytes, transition: dict) -> None:
        """Hold ``transition``, decoded from the record ``value`` (re-read after a restart)."""
        self.records[key] = StoredTransition(value, transition)

    def decoded_from(self, transition: dict | None, value: bytes) -> dict | None:
        """Note that ``transition`` was decoded from the record ``value``: stored, it keeps
        those bytes instead of being encoded again. Returns ``transition``."""
        self._source = (transition, value)
        return transition

    def __getitem__(self, key: str) -> StoredTransition:
        return self.records[key]

    def __setitem__(self, key: str, transition: Mapping) -> None:
        if isinstance(transition, StoredTransition):
            self.records[key] = transition
            return
        src = self._source
        value = src[1] if src is not None and src[0] is transition else codec.encode("transition", dict(transition))
        self.records[key] = StoredTransition(value, transition)

    def __delitem__(self, key: str) -> None:
        del self.records[key]

    def __contains__(self, key) -> bool:
        return key in self.records

    def __iter__(self):
        return iter(self.records)

    def __len__(self) -> int:
        return len(self.records)


def encode_sample(sample: dict) -> bytes:
    """A sample dict (grouping's) as its record: around the stored transition's record when
    it has one of the version the sample embeds (codec.encode_around: no decode/encode of
    its token arrays), else :func:`codec.encode` of the decoded transition."""
    tr = sample["transition"]
    if isinstance(tr, StoredTransition):
        value = codec.encode_around("sample", {k: v for k, v in sample.items() if k != "transition"},
                                    "transition", tr.record)
        if value is not None:
            return value
        tr = dict(tr)
    return codec.encode("sample", {**sample, "transition": tr})
