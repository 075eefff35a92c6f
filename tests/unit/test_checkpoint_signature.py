"""Signed checkpoints: the trainer signs the manifest (HMAC-SHA256 under the stack's key), the
reloader serves only what verifies and names the reason of every refusal; the stack's secrets
are made once, mode 0600, and found by the settings."""
from __future__ import annotations

import json
import stat
from types import SimpleNamespace

import pytest

from spanrl.core import credentials
from spanrl.core.settings import Settings
from spanrl.trainer import checkpoint
from spanrl.trainer.reloader import Reloader

KEY = b"K" * 32
#: the signature of _ckpt's manifest under KEY (its bytes are fixed: sorted keys, the files' sha256)
SIGNATURE = "6fc80837ebde42b64a5eef4891bc85f538e978057e3ab6496e535379721a19f1"
MANIFEST_SHA256 = "48d84a108e2e873db0b16772e9d1985df0c10c7647579d84fcfa4abf7d2a63d8"


def _ckpt(tmp_path):
    d = tmp_path / "000001"
    d.mkdir()
    (d / "model.safetensors").write_bytes(b"weights" * 100)
    (d / "config.json").write_text('{"a": 1}')
    checkpoint.write_manifest(d, run="r", version=1, parent_version=0, base_model="base", step=3,
                              trained_offsets={"samples:0": 17}, metrics={"loss": 0.5})
    return d


def _reason(fn, *args) -> str:
    with pytest.raises(checkpoint.CheckpointError) as info:
        fn(*args)
    return info.value.reason


def test_hmac_sha256_known_answer():
    # RFC 4231, test case 2
    assert credentials.sign(b"Jefe", b"what do ya want for nothing?") == \
        "5bdcc146bf60754e6a042426089575c75a003f089d2739839dec58b964ec3843"
    assert credentials.verify(b"Jefe", b"what do ya want for nothing?",
                              "5bdcc146bf60754e6a042426089575c75a003f089d2739839dec58b964ec3843\n")
    assert not credentials.verify(b"Jefe", b"what do ya want for nothing!",
                                  "5bdcc146bf60754e6a042426089575c75a003f089d2739839dec58b964ec3843")


def test_signed_checkpoint_verifies_and_the_signature_is_not_a_listed_file(tmp_path):
    d = _ckpt(tmp_path)
    assert checkpoint.sign_manifest(d, KEY) == SIGNATURE
    assert (d / checkpoint.SIGNATURE).read_text() == SIGNATURE + "\n"
    assert checkpoint.manifest_sha256(d) == MANIFEST_SHA256  # signing leaves the manifest as it was
    assert set(checkpoint.verify_manifest(d)["files"]) == {"model.safetensors", "config.json"}
    checkpoint.verify_signature(d, KEY)
    # a manifest rewritten in a signed directory does not list the old signature
    again = checkpoint.write_manifest(d, run="r", version=1, parent_version=0, base_model="base", step=3,
                                      trained_offsets={"samples:0": 17}, metrics={"loss": 0.5})
    assert checkpoint.SIGNATURE not in again["files"]


def test_unsigned_tampered_and_wrong_key_are_refused_with_their_reason(tmp_path):
    d = _ckpt(tmp_path)
    assert _reason(checkpoint.verify_signature, d, KEY) == "unsigned"
    checkpoint.sign_manifest(d, KEY)
    assert _reason(checkpoint.verify_signature, d, b"L" * 32) == "bad_signature"  # wrong key
    # tampered weights: the manifest's sha256 no longer matches (the signature still does)
    weights = (d / "model.safetensors").read_bytes()
    (d / "model.safetensors").write_bytes(b"evil" * 100)
    assert _reason(checkpoint.verify_manifest, d) == "sha256_mismatch"
    (d / "model.safetensors").write_bytes(weights)
    # tampered manifest, made consistent with tampered weights: only the signature tells
    (d / "model.safetensors").write_bytes(b"evil" * 100)
    manifest = json.loads((d / checkpoint.MANIFEST).read_text())
    manifest["files"]["model.safetensors"] = checkpoint.sha256_file(d / "model.safetensors")
    (d / checkpoint.MANIFEST).write_text(json.dumps(manifest, indent=2, sort_keys=True))
    checkpoint.verify_manifest(d)  # passes: hashes agree
    assert _reason(checkpoint.verify_signature, d, KEY) == "bad_signature"


def test_a_file_the_manifest_does_not_list_is_refused(tmp_path):
    d = _ckpt(tmp_path)
    checkpoint.sign_manifest(d, KEY)
    (d / "extra.safetensors").write_bytes(b"x")  # vLLM would load it
    assert _reason(checkpoint.verify_signature, d, KEY) == "unlisted_file"


def test_reloader_checks_the_signature_under_the_stacks_key(tmp_path):
    d = _ckpt(tmp_path)
    state = tmp_path / "state"
    closed = SimpleNamespace(settings=Settings(_env_file=None, state_dir=state))
    assert _reason(Reloader._check_signature, closed, d) == "no_signing_key"
    Reloader._check_signature(SimpleNamespace(settings=Settings(_env_file=None, auth="open", state_dir=state)), d)
    credentials.ensure_secrets(state, (credentials.CHECKPOINT_KEY,))
    key = closed.settings.checkpoint_key()
    assert len(key) == 43  # 32 random bytes, URL-safe base64 without padding
    assert _reason(Reloader._check_signature, closed, d) == "unsigned"
    checkpoint.sign_manifest(d, b"not the stack's key")
    assert _reason(Reloader._check_signature, closed, d) == "bad_signature"
    checkpoint.sign_manifest(d, key)
    Reloader._check_signature(closed, d)


def test_secrets_are_made_once_private_and_found_by_the_settings(tmp_path, monkeypatch):
    for name in ("SPANRL_AUTH_TOKEN", "SPANRL_AUTH_TOKEN_FILE", "SPANRL_ADMIN_TOKEN", "SPANRL_AUTH"):
        monkeypatch.delenv(name, raising=False)
    state = tmp_path / "state"
    assert Settings(_env_file=None, state_dir=state).auth_token is None
    assert credentials.ensure_secrets(state) == ["agent_token", "admin_token", "checkpoint_key"]
    d = credentials.secrets_dir(state)
    assert stat.S_IMODE(d.stat().st_mode) == 0o700
    assert {p.name: stat.S_IMODE(p.stat().st_mode) for p in d.iterdir()} == {
        "agent_token": 0o600, "admin_token": 0o600, "checkpoint_key": 0o600}
    values = {p.name: p.read_text() for p in d.iterdir()}
    assert len(set(values.values())) == 3
    assert credentials.ensure_secrets(state) == []  # a later start reuses them
    assert {p.name: p.read_text() for p in d.iterdir()} == values
    s = Settings(_env_file=None, state_dir=state)
    assert s.auth_token.get_secret_value() == values["agent_token"].strip()
    assert s.admin_token.get_secret_value() == values["admin_token"].strip()
    monkeypatch.setenv("SPANRL_ADMIN_TOKEN", "from-env")  # the variable wins over the file
    assert Settings(_env_file=None, state_dir=state).admin_token.get_secret_value() == "from-env"
    (d / "admin_token").write_text("")  # emptied: made again
    assert credentials.ensure_secrets(state) == ["admin_token"]
