"""spanrl's chat template for SmolLM2 with tools (infra/chat_templates/smollm2_tools.jinja),
rendered the way vLLM renders it (transformers' ``render_jinja_template``)."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
from transformers.utils.chat_template_utils import render_jinja_template

from spanrl.core.settings import Settings

ROOT = Path(__file__).resolve().parents[2]
TEMPLATE = (ROOT / Settings().vllm_chat_template).read_text()
SYSTEM = "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather of a city",
                                            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}
TOOL_PROMPT = (
    "\n\nYou may call functions to help with the request. The functions, as JSON, are inside <tools></tools>:\n"
    "<tools>\n" + json.dumps(WEATHER) + "\n</tools>\n"
    "To call a function, answer with one JSON object per call, each inside <tool_call></tool_call>:\n"
    '<tool_call>\n{"name": "<function name>", "arguments": {"<parameter>": "<value>"}}\n</tool_call>')
NO_TOOLS = [
    [{"role": "user", "content": "hi"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"},
     {"role": "assistant", "content": "4"}, {"role": "user", "content": ""}],
    [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}],
]


def render(messages, tools=None, template=TEMPLATE, generation=True) -> str:
    return render_jinja_template([messages], tools=tools, chat_template=template, add_generation_prompt=generation)[0][0]


def test_without_tools_it_renders_smollm2s_chatml():
    assert render(NO_TOOLS[0]) == SYSTEM + "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert render(NO_TOOLS[1], generation=False) == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\n2+2?<|im_end|>\n"
        "<|im_start|>assistant\n4<|im_end|>\n<|im_start|>user\n<|im_end|>\n")


@pytest.mark.parametrize("messages", NO_TOOLS)
@pytest.mark.parametrize("generation", [True, False])
def test_without_tools_it_renders_exactly_what_the_models_own_template_does(messages, generation):
    own = Settings().model_dir / "chat_template.jinja"
    assert own.exists(), f"no converted model at {own.parent}: `make test` / `make test-unit` convert it first"
    assert render(messages, generation=generation) == render(messages, template=own.read_text(), generation=generation)


def test_tools_are_listed_in_the_default_system_turn():
    assert render([{"role": "user", "content": "Weather in Oslo?"}], tools=[WEATHER]) == (
        SYSTEM.removesuffix("<|im_end|>\n") + TOOL_PROMPT + "<|im_end|>\n"
        "<|im_start|>user\nWeather in Oslo?<|im_end|>\n<|im_start|>assistant\n")


def test_tools_follow_the_clients_system_turn():
    out = render([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "x"}], tools=[WEATHER])
    assert out.startswith("<|im_start|>system\nBe brief." + TOOL_PROMPT + "<|im_end|>\n<|im_start|>user\nx<|im_end|>\n")


def test_tool_calls_and_results_in_the_history():
    # vLLM hands the template arguments as dicts (it parses OpenAI's JSON strings); strings pass through
    messages = [
        {"role": "user", "content": "Weather in Oslo and Rome?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Oslo"}}},
            {"id": "c2", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Rome"}'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "rain"},
        {"role": "tool", "tool_call_id": "c2", "content": "sun"},
        {"role": "assistant", "content": "Checking.", "tool_calls": [
            {"id": "c3", "type": "function", "function": {"name": "get_weather", "arguments": {}}}]},
    ]
    out = render(messages, tools=[WEATHER], generation=False)
    assert out.split("<|im_end|>\n", 2)[2] == (
        "<|im_start|>assistant\n"
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>\n'
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}\n</tool_call><|im_end|>\n'
        "<|im_start|>tool\n<tool_response>\nrain\n</tool_response><|im_end|>\n"
        "<|im_start|>tool\n<tool_response>\nsun\n</tool_response><|im_end|>\n"
        '<|im_start|>assistant\nChecking.\n<tool_call>\n{"name": "get_weather", "arguments": {}}\n</tool_call><|im_end|>\n')
