"""What attaches to agents: OTel setup, the OTLP bridge, the LLM proxy, rewards, the runner.

Agents use :mod:`producers.instrument` (``instrument``, ``rollout_context``,
``emit_reward``, ``flush``); the services run as ``python -m producers.bridge`` and
``python -m producers.proxy``; :mod:`producers.runner` runs agents on tasks.
"""
