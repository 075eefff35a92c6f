"""Where everything lives and listens: one settings object read from the environment.

Every field can be set as ``SPANRL_<FIELD>`` (e.g. ``SPANRL_KAFKA_PORT=29092``) or in
a ``.env`` file. Ports bind to ``host`` (loopback by default). Secrets (MinIO keys, the
bearer token) come only from the environment (or a file); the defaults are for the local
throwaway stack. Secrets are ``SecretStr``: they print as ``**********``.
"""
from __future__ import annotations

import os
from functools import lru_cache
from pathlib import Path

from pydantic import SecretStr, field_validator, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict


def _default_cache() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "spanrl"


class Settings(BaseSettings):
    """Configuration of the local stack and of spanrl's services (env prefix ``SPANRL_``)."""

    model_config = SettingsConfigDict(env_prefix="SPANRL_", env_file=".env", extra="ignore")

    host: str = "127.0.0.1"
    cache_dir: Path = _default_cache()
    #: run-time state of the stack (logs, Kafka log dirs, MinIO data); inside the clone
    state_dir: Path = Path(".spanrl")

    kafka_port: int = 19092
    kafka_controller_port: int = 19093
    kafka_version: str = "4.1.1"
    minio_port: int = 19000
    minio_console_port: int = 19001
    minio_access_key: str = "spanrl"
    minio_secret_key: SecretStr = SecretStr("spanrl-local-secret")
    checkpoint_bucket: str = "spanrl-checkpoints"
    payload_bucket: str = "spanrl-payloads"
    vllm_port: int = 18000
    bridge_port: int = 14318
    #: the bridge's OTLP/gRPC receiver (the role of OTLP's 4317; producers/otlp_grpc.py); 0: none
    bridge_grpc_port: int = 14317
    proxy_port: int = 18080
    faust_web_port: int = 16066
    reloader_port: int = 18090
    trainer_port: int = 18091
    #: where services reach Kafka and MinIO when those run elsewhere (infra/deploy/: other
    #: hosts or containers); empty: ``host:kafka_port`` / ``host:minio_port``, the local
    #: stack. Kafka: comma-separated ``host:port`` list; MinIO: one ``host:port``
    kafka_bootstrap_servers: str = ""
    minio_address: str = ""
    #: the web dashboard (infra/dashboard): rollouts, traces, training, pipeline
    dashboard_port: int = 18092
    #: rollouts the dashboard keeps in memory (the oldest seen is evicted; infra/dashboard/views.py)
    dashboard_max_rollouts: int = 5000

    #: served model name at vLLM and in spans
    model_name: str = "policy"
    #: the base policy, one of infra/model.py's MODELS (``smollm2-135m`` | ``qwen2.5-coder-0.5b``):
    #: it decides the cache directory of its converted weights, vLLM's chat template and
    #: tool-call parser (unless set below); ``make bootstrap`` prepares the chosen one
    model: str = "smollm2-135m"
    #: directory of the base model (safetensors); default: the chosen model converted in the cache
    base_model_dir: Path | None = None
    run: str = "default"
    #: the run seed: every rollout's sampling seed is derived from it, the task, the rollout's
    #: index in its group, the attempt and the call (producers/seeding.py), and sent to vLLM;
    #: the trainer's torch seed defaults to it. ``SPANRL_SEED=none`` (or empty): unseeded
    #: sampling (vLLM's own randomness)
    seed: int | None = 0
    #: vLLM's ``--tool-call-parser`` (with ``--enable-auto-tool-choice``), so requests with
    #: ``tools`` work; ``hermes`` reads ``<tool_call>{"name", "arguments"}</tool_call>``, the
    #: format :attr:`vllm_chat_template` asks for. Empty: no parser (``tools`` get 400 from
    #: vLLM). Unset: the model's (infra/model.py)
    vllm_tool_call_parser: str | None = None
    #: vLLM's ``--chat-template`` (relative paths from the repository root). Empty: the
    #: model's own template. Unset: the model's choice (SmolLM2's own template ignores
    #: ``tools``, so it gets ours, which renders them and everything else as SmolLM2's does)
    vllm_chat_template: str | None = None

    #: bearer token the bridge and the proxy demand on every route but ``GET /health``
    #: (None: no auth). ``SPANRL_AUTH_TOKEN``, or the file named by ``SPANRL_AUTH_TOKEN_FILE``
    auth_token: SecretStr | None = None
    auth_token_file: Path | None = None
    #: bytes of encoded records the bridge holds waiting for Kafka's acks; a request that
    #: would go over gets 503 ``buffer_full`` at once
    bridge_max_inflight_bytes: int = 64 << 20
    #: seconds a producer waits for Kafka's acks before answering 503 ``kafka_unavailable``
    kafka_send_timeout_s: float = 15.0
    #: experiment tracking of the trainer, the main job and ``spanrl eval``: tensorboard |
    #: mlflow | wandb (offline) | none (trainer/tracking.py)
    tracker: str = "tensorboard"
    #: where tracking logs go (``RUN/trainer``, ``RUN/main_job``, ``eval/NAME`` below it);
    #: default ``state_dir/tensorboard`` (``tensorboard --logdir .spanrl/tensorboard``)
    tracker_dir: Path | None = None

    @field_validator("seed", mode="before")
    @classmethod
    def _seed_none(cls, value):
        """``none`` / ``null`` / empty: no run seed."""
        if isinstance(value, str) and value.strip().lower() in ("", "none", "null"):
            return None
        return value

    @model_validator(mode="after")
    def _model_defaults(self) -> "Settings":
        """An unknown ``model`` is an error listing the known ones; the chat template and the
        tool-call parser left unset are the model's."""
        from spanrl.infra.model import model_spec

        spec = model_spec(self.model)
        if self.vllm_tool_call_parser is None:
            self.vllm_tool_call_parser = spec.tool_call_parser
        if self.vllm_chat_template is None:
            self.vllm_chat_template = spec.chat_template
        return self

    @model_validator(mode="after")
    def _read_auth_token(self) -> "Settings":
        """An empty ``SPANRL_AUTH_TOKEN`` means no auth; a token file must hold a token."""
        if self.auth_token is not None and not self.auth_token.get_secret_value().strip():
            self.auth_token = None
        if self.auth_token is None and self.auth_token_file is not None:
            token = self.auth_token_file.read_text().strip()
            if not token:
                raise ValueError(f"SPANRL_AUTH_TOKEN_FILE {self.auth_token_file} is empty")
            self.auth_token = SecretStr(token)
        return self

    @property
    def kafka_bootstrap(self) -> str:
        return self.kafka_bootstrap_servers or f"{self.host}:{self.kafka_port}"

    @property
    def minio_endpoint(self) -> str:
        return self.minio_address or f"{self.host}:{self.minio_port}"

    @property
    def vllm_url(self) -> str:
        return f"http://{self.host}:{self.vllm_port}"

    @property
    def bridge_url(self) -> str:
        return f"http://{self.host}:{self.bridge_port}"

    @property
    def bridge_grpc_endpoint(self) -> str:
        """What ``OTEL_EXPORTER_OTLP_ENDPOINT`` of a gRPC exporter names: ``http://host:port``
        (``http``: no TLS, the exporter's ``insecure``)."""
        return f"http://{self.host}:{self.bridge_grpc_port}"

    @property
    def proxy_url(self) -> str:
        return f"http://{self.host}:{self.proxy_port}"

    @property
    def tracker_root(self) -> Path:
        return self.tracker_dir or (self.state_dir / "tensorboard")

    @property
    def dashboard_url(self) -> str:
        return f"http://{self.host}:{self.dashboard_port}"

    @property
    def model_dir(self) -> Path:
        from spanrl.infra.model import model_spec

        return self.base_model_dir or (self.cache_dir / "models" / model_spec(self.model).dir_name)


@lru_cache(maxsize=1)
def get_settings() -> Settings:
    """The process-wide settings (read once from the environment)."""
    return Settings()
