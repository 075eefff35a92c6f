"""The ground floor: what every service shares, below producers, stream_jobs and trainer.

- ``settings``: every ``SPANRL_*`` setting, declared once; the only reader of the environment.
- ``model``: the base policies spanrl knows (the registry) and their conversion to safetensors.
- ``edge``: bearer-token auth and ``BadRequest``, the HTTP edge every service shares.
- ``ids``, ``production``, ``response_ids``: the limits of client ids, the ``x-spanrl-*``
  production headers, the minted response ids (written by the proxy, read by the stream job).
- ``claims``: the claim-check of oversize spans in MinIO (the bridge and the proxy check in,
  the stream job resolves).
- ``dead_letters``: reason codes and the dead-letter record (stream job, trainer, ledger).
- ``metrics``: Prometheus families of every service's ``/metrics``.
- ``intervals``: confidence intervals (evaluation, study, the release gate).
- ``partitions``: a topic's partitions as a consumer sees them (trainer, reloader).
- ``shm``: /dev/shm segments and which live processes map them (the stack and the trainer
  remove what killed processes leave in RAM).
- ``plugins``: ``module:attribute`` references resolved at run time (an agent, the release
  gate's evaluation), so a service names a higher layer's code without importing it.
- ``recipes``: named trainer recipes as data, each value with its source (``default``: the
  measured one); ``SPANRL_RECIPE`` selects one below the environment.
- ``agent_spec``: :class:`AgentSpec`, an agent as every command that takes one sees it (its
  runner, tasks, reward components, demo); loaded by reference in ``spanrl.infra.agents``.

It imports only ``spanrl.schemas`` (and the topic table reads ``settings``: the one edge
upward from schemas, named in pyproject.toml's import contract). The layers and the tool
that checks them: DEVELOPERS.md, "Where things are".
"""
