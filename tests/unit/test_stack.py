"""Pure parts of the local stack."""
import base64

from spanrl.infra.stack import _kafka_cluster_id


def test_kafka_cluster_ids_are_16_bytes_and_never_look_like_options():
    ids = [_kafka_cluster_id() for _ in range(2000)]  # ~31 of 2000 raw ids would start with '-'
    assert not any(i.startswith("-") for i in ids)
    assert all(len(base64.urlsafe_b64decode(i + "==")) == 16 for i in ids)
    assert len(set(ids)) == len(ids)
