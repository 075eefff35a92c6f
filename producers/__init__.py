"""What attaches to agents: OTel setup, the OTLP bridge, the LLM proxy, rewards, the runner.

Agents import only :mod:`producers.instrument` (cheap); the services are run as
``python -m producers.bridge`` / ``python -m producers.proxy`` and the runner from code.
"""
from producers.instrument import emit_reward, flush, instrument, rollout_context

__all__ = ["emit_reward", "flush", "instrument", "rollout_context"]
