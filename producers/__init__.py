"""What attaches to agents: OTel setup, the OTLP bridge, the LLM proxy, rewards, the runner.

Agents use :mod:`spanrl.producers.instrument` (``instrument``, ``rollout_context``,
``emit_reward``, ``flush``); the services run as ``python -m spanrl.producers.bridge`` and
``python -m spanrl.producers.proxy``; :mod:`spanrl.producers.runner` runs agents on tasks.
"""
