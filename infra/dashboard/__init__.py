"""The web dashboard: rollouts, traces, training and the pipeline, read from the topics
(``python -m spanrl.infra.dashboard``; see infra/README.md, "Dashboard")."""
