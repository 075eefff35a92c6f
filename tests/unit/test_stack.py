"""Pure parts of the local stack."""
import base64

from pathlib import Path

from spanrl.core.settings import Settings
from spanrl.infra.stack import _kafka_cluster_id, vllm_args


def test_kafka_cluster_ids_are_16_bytes_and_never_look_like_options():
    ids = [_kafka_cluster_id() for _ in range(2000)]  # ~31 of 2000 raw ids would start with '-'
    assert not any(i.startswith("-") for i in ids)
    assert all(len(base64.urlsafe_b64decode(i + "==")) == 16 for i in ids)
    assert len(set(ids)) == len(ids)


def test_vllm_args_turn_on_the_tool_call_parser_and_chat_template():
    s = Settings(base_model_dir=Path("/m"), vllm_port=28000, vllm_tool_call_parser="hermes",
                 vllm_chat_template="infra/chat_templates/smollm2_tools.jinja")
    assert vllm_args(s, root=Path("/repo")) == [
        "--model", "/m", "--served-model-name", "policy", "--host", "127.0.0.1", "--port", "28000",
        "--dtype", "float32", "--enforce-eager", "--max-model-len", "2048", "--disable-uvicorn-access-log",
        "--enable-auto-tool-choice", "--tool-call-parser", "hermes",
        "--chat-template", "/repo/infra/chat_templates/smollm2_tools.jinja"]
    off = vllm_args(Settings(base_model_dir=Path("/m"), vllm_tool_call_parser="", vllm_chat_template=""))
    assert off[-1] == "--disable-uvicorn-access-log" and "--tool-call-parser" not in off
    assert vllm_args(Settings(vllm_chat_template="/abs/t.jinja"), root=Path("/repo"))[-1] == "/abs/t.jinja"


def test_default_settings_serve_tools_with_hermes_and_an_existing_template():
    s = Settings()
    assert s.vllm_tool_call_parser == "hermes"
    assert (Path(__file__).resolve().parents[2] / s.vllm_chat_template).is_file()
