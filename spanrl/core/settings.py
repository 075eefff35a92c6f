"""spanrl's one settings system: every ``SPANRL_*`` variable, declared once, and the only
module that reads (or writes) the process environment.

Each component's settings are a section (a pydantic-settings class with its env prefix);
every field is ``SPANRL_<PREFIX-REST><FIELD>`` and declares its type, default, unit and
readers (:func:`setting`). The sections:

- :class:`Settings` (``SPANRL_``): where everything lives and listens, shared by every
  service (also read from a ``.env`` file, the only section that is). Ports bind to
  ``host`` (loopback by default). Secrets (MinIO keys, the bearer token) come only from
  the environment (or a file); the defaults are for the local throwaway stack. Secrets are
  ``SecretStr``: they print as ``**********``.
- :class:`TopicSettings`, :class:`ProducerSettings`, :class:`StreamSettings`,
  :class:`DashboardSettings`, :class:`StackSettings` (``SPANRL_``): one component each.
- :class:`TrainerConfig` (``SPANRL_TRAINER_``), :class:`ReloaderConfig`
  (``SPANRL_RELOADER_``), re-exported by trainer/train.py and trainer/reloader.py.
- :class:`DeploymentSettings`: names only ``infra/deploy/`` and ``infra/otelcol/`` read.

:func:`check_environment` (each service's ``main`` and ``Stack.up``) refuses a ``SPANRL_*``
variable no section declares, naming the closest declared one. The process-environment
helpers (:func:`env_value`, :func:`set_env`, :func:`setdefault_env`, :func:`update_env`,
:func:`child_env`, :func:`env_with_prefix`) are the way other modules touch ``os.environ``.
The documentation's settings reference (docs/reference/settings.md) is :func:`markdown_table`
(``python -m spanrl.core.settings --write docs/reference/settings.md``;
tests/unit/test_settings_system.py fails when the page is stale).
"""
from __future__ import annotations

import argparse
import contextvars
import difflib
import os
from collections.abc import Mapping
from functools import lru_cache
from pathlib import Path
from typing import Any, ClassVar, Literal

from pydantic import Field, SecretStr, field_validator, model_validator
from pydantic_settings import BaseSettings, PydanticBaseSettingsSource, SettingsConfigDict

PREFIX = "SPANRL_"


#: port distance between replicas of one stack component (Kafka nodes, stream workers, bridges)
PORT_STRIDE = 100
#: ``spanrl stack up --cluster``: the layout of infra/deploy/compose.yaml's stateful and stream
#: tiers as processes on one machine (3 KRaft brokers, 2 Faust workers, 2 bridges)
CLUSTER_LAYOUT = {"kafka_brokers": 3, "stream_workers": 2, "bridge_replicas": 2}


def replica_ports(first: int, n: int) -> list[int]:
    """The ports of ``n`` replicas of one stack component: ``first``, ``first + 100``, ..."""
    return [first + PORT_STRIDE * i for i in range(n)]


def default_replication(brokers: int) -> int:
    """Replicas of a topic on a cluster of ``brokers``: 1 on one or two brokers, 3 from three on
    (with ``min.insync.replicas`` 2 an acks=all write then survives the loss of one broker;
    Kafka's docs, "Replication")."""
    return 3 if brokers >= 3 else 1


def _default_cache() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "spanrl"


def _topic(name: str):
    """Default factory: the name of ``spanrl.schemas.topics.<name>`` (imported when called:
    schemas/topics.py itself reads :class:`TopicSettings`)."""
    def default() -> str:
        from spanrl.schemas import topics

        return getattr(topics, name).name
    return default


def recipe_setting(field_name: str, doc: str = "", **kw) -> Any:
    """A :class:`TrainerConfig` setting whose default is recipe ``default``'s value of it
    (spanrl/core/recipes.py ``DEFAULT``, each value with the study that measured it: the one
    place it is written); the settings reference marks it ``(recipe default)``."""
    from spanrl.core.recipes import DEFAULT

    made = setting(DEFAULT.fields[field_name].value, doc, **kw)
    made.json_schema_extra["recipe"] = "default"
    return made


def setting(default: Any = ..., doc: str = "", *, unit: str = "", readers: str, shown: str | None = None,
            default_factory=None) -> Any:
    """One declared setting: its default (or ``default_factory``), what it means (``doc``),
    its unit (``s``, ``bytes``, ...; "" for none) and the components that read it
    (``readers``); ``shown``: the default as the settings reference writes it when the value itself
    depends on the machine or on another setting."""
    extra = {"unit": unit, "readers": readers, "shown": shown}
    if default_factory is not None:
        return Field(default_factory=default_factory, description=doc, json_schema_extra=extra)
    return Field(default, description=doc, json_schema_extra=extra)


_ENVIRON: contextvars.ContextVar[Mapping[str, str] | None] = contextvars.ContextVar("spanrl_environ", default=None)


#: vLLM's ``--logprobs-mode`` that makes its log-probs those of the distribution it sampled
#: from (after temperature): what a rollout temperature needs (infra/stack.py, the proxy)
PROCESSED_LOGPROBS = "processed_logprobs"


def _none_word(value: Any) -> Any:
    """None for an optional setting written as ``none`` / ``null`` / empty (any case), else ``value``."""
    if isinstance(value, str) and value.strip().lower() in ("", "none", "null"):
        return None
    return value


class _MappingSource(PydanticBaseSettingsSource):
    """A section's values from an explicit mapping of variable names (:meth:`Section.from_environ`)."""

    def __init__(self, settings_cls: type["Section"], environ: Mapping[str, str]):
        super().__init__(settings_cls)
        self.environ = {k.upper(): v for k, v in environ.items()}

    def get_field_value(self, field, field_name: str):
        name = self.settings_cls.env_name(field_name)
        return self.environ.get(name), name, False

    def __call__(self) -> dict[str, Any]:
        out = {}
        for name, field in self.settings_cls.model_fields.items():
            value, _, _ = self.get_field_value(field, name)
            if value is not None:
                out[name] = value
        return out


class _RecipeSource(PydanticBaseSettingsSource):
    """TrainerConfig's values from the recipe ``SPANRL_RECIPE`` names (spanrl/core/recipes.py):
    below the environment's ``SPANRL_TRAINER_*``, above the declared defaults."""

    def get_field_value(self, field, field_name: str):
        return None, field_name, False  # the recipe is read whole in __call__

    def __call__(self) -> dict[str, Any]:
        from spanrl.core.recipes import recipe_values

        name = Settings.from_environ(_ENVIRON.get()).recipe
        return recipe_values(name) if name else {}


class Section(BaseSettings):
    """A component's settings: ``env_prefix`` + field name is each variable's name."""

    model_config = SettingsConfigDict(env_prefix=PREFIX, extra="ignore")
    #: the section's heading in the settings reference's table
    TITLE: ClassVar[str] = ""

    @classmethod
    def settings_customise_sources(cls, settings_cls, init_settings, env_settings, dotenv_settings,
                                   file_secret_settings):
        environ = _ENVIRON.get()
        if environ is None:
            return init_settings, env_settings, dotenv_settings, file_secret_settings
        return init_settings, _MappingSource(settings_cls, environ)

    @classmethod
    def env_name(cls, field: str) -> str:
        return (cls.model_config.get("env_prefix", "") + field).upper()

    @classmethod
    def env_names(cls) -> dict[str, str]:
        """Variable name -> field name."""
        return {cls.env_name(f): f for f in cls.model_fields}

    @classmethod
    def from_environ(cls, environ: Mapping[str, str] | None = None, **overrides):
        """The section read from ``environ`` (a mapping of variable names; no ``.env`` file)
        instead of the process environment; None: the process environment (as ``cls()``)."""
        if environ is None:
            return cls(**overrides)
        token = _ENVIRON.set(environ)
        try:
            return cls(**overrides)
        finally:
            _ENVIRON.reset(token)

    @classmethod
    def env(cls, **values: Any) -> dict[str, str]:
        """The variables that give a child process (or this one, :func:`update_env`) these
        ``values``, keyed by field name: ``TrainerConfig.env(lr="5e-5", http=False)`` ->
        ``{"SPANRL_TRAINER_LR": "5e-5", "SPANRL_TRAINER_HTTP": "false"}``. A name that is not a
        field raises :class:`UnknownSetting` (with the closest declared variable); a value the
        field cannot take raises pydantic's ValidationError; None is refused (unset it instead)."""
        unknown = [cls.env_name(k) for k in values if k not in cls.model_fields]
        if unknown:
            raise UnknownSetting(unknown, {n: closest_name(n) for n in unknown})
        out = {}
        for field, value in values.items():
            if value is None:
                raise ValueError(f"{cls.env_name(field)}: None cannot be written to the environment")
            out[cls.env_name(field)] = str(value).lower() if isinstance(value, bool) else str(value)
        cls.from_environ(out)  # every value parses as its field
        return out

    @classmethod
    def default(cls, field: str) -> Any:
        """The declared default of ``field`` (the one place it is written)."""
        return cls.model_fields[field].get_default(call_default_factory=True)


class Settings(Section):
    """Configuration of the local stack and of spanrl's services (env prefix ``SPANRL_``)."""

    model_config = SettingsConfigDict(env_prefix=PREFIX, env_file=".env", extra="ignore")
    TITLE: ClassVar[str] = "Stack-wide (`Settings`; also read from `.env`)"

    host: str = setting("127.0.0.1", "address every service binds to and is reached at", readers="every service")
    cache_dir: Path = setting(_default_cache(), "downloads, the venv, converted models, compiled extensions",
                              readers="stack, cli, trainer, reloader, model",
                              shown="`$XDG_CACHE_HOME/spanrl` (`~/.cache/spanrl`)")
    state_dir: Path = setting(Path(".spanrl"), "run-time state of the stack (logs, Kafka log dirs, MinIO data); "
                              "inside the clone", readers="stack, trainer, replay, main job")

    kafka_port: int = setting(19092, "Kafka's listener", readers="stack")
    kafka_controller_port: int = setting(19093, "Kafka's KRaft controller listener", readers="stack")
    kafka_brokers: int = setting(1, "brokers of the stack's Kafka: 1, or >= 3 for a replicated KRaft cluster "
                                 "(replication factor 3, `min.insync.replicas` 2; broker i listens on "
                                 "`kafka_port` + 100(i-1), its controller on `kafka_controller_port` + 100(i-1))",
                                 readers="stack, every service")
    kafka_version: str = setting("4.1.1", "the Kafka release the stack downloads and runs", readers="stack")
    minio_port: int = setting(19000, "MinIO's S3 API", readers="stack")
    minio_console_port: int = setting(19001, "MinIO's console", readers="stack")
    minio_access_key: str = setting("spanrl", "MinIO's access key",
                                    readers="stack, producers, stream, trainer, reloader")
    minio_secret_key: SecretStr = setting(SecretStr("spanrl-local-secret"), "MinIO's secret key",
                                          readers="stack, producers, stream, trainer, reloader",
                                          shown="`spanrl-local-secret`")
    checkpoint_bucket: str = setting("spanrl-checkpoints", "bucket of the trainer's checkpoints",
                                     readers="trainer, reloader, setup job, stack, cli")
    payload_bucket: str = setting("spanrl-payloads", "bucket of oversize payloads (claims)",
                                  readers="bridge, proxy, stream, setup job, stack")
    vllm_port: int = setting(18000, "vLLM's OpenAI server", readers="stack, proxy, reloader")
    bridge_port: int = setting(14318, "the bridge's OTLP/HTTP receiver", readers="bridge, runner, stack")
    bridge_grpc_port: int = setting(14317, "the bridge's OTLP/gRPC receiver (the role of OTLP's 4317; "
                                    "producers/otlp_grpc.py); 0: none", readers="bridge, stack")
    proxy_port: int = setting(18080, "the LLM proxy", readers="proxy, runner, reloader, stack")
    faust_web_port: int = setting(16066, "the stream worker's web server (health, counters, metrics)",
                                  readers="stream, stack")
    stream_workers: int = setting(1, "Faust workers the stack starts for the stream job, one consumer group "
                                  "sharing the partitions (worker i: component `stream<i>`, web server on "
                                  "`faust_web_port` + 100(i-1)); `spanrl stack up --cluster` starts 2",
                                  readers="stack, chaos")
    bridge_replicas: int = setting(1, "OTLP bridges the stack starts (bridge i: component `bridge<i>`, on `bridge_port` "
                           "and `bridge_grpc_port` + 100(i-1)); stateless, so any may take any export: the chaos "
                           "workload sends each rollout to one by its id; `spanrl stack up --cluster` starts 2",
                           readers="stack, chaos")
    reloader_port: int = setting(18090, "the reloader's HTTP status and admin", readers="reloader, proxy, stack, eval")
    trainer_port: int = setting(18091, "the trainer's HTTP status and admin", readers="trainer, stack, dashboard")
    kafka_bootstrap_servers: str = setting("", "where services reach Kafka when it runs elsewhere (infra/deploy/): "
                                           "comma-separated `host:port` list; empty: `host:kafka_port`",
                                           readers="every service")
    minio_address: str = setting("", "where services reach MinIO when it runs elsewhere: one `host:port`; "
                                 "empty: `host:minio_port`", readers="producers, stream, trainer, reloader, setup job")
    dashboard_port: int = setting(18092, "the web dashboard (infra/dashboard)", readers="dashboard, stack")
    dashboard_max_rollouts: int = setting(5000, "rollouts the dashboard keeps in memory (the oldest seen is "
                                          "evicted; infra/dashboard/views.py)", readers="dashboard")
    schema_registry_port: int = setting(18081, "the schema registry's HTTP API (Apicurio Registry; its "
                                        "Confluent-compatible API under `/apis/ccompat/v7`)", readers="stack")
    schema_registry_address: str = setting("", "where services and Kafka tools reach the schema registry when it "
                                           "runs elsewhere: the root URL of its Confluent-compatible API; empty: "
                                           "`http://host:schema_registry_port/apis/ccompat/v7`",
                                           readers="stack, setup job, stream, trainer (ids unknown locally)")
    schema_registry_version: str = setting("3.3.3", "the Apicurio Registry release the stack downloads "
                                           "(`io.apicurio:apicurio-registry-app`, Maven Central) and runs",
                                           readers="stack")
    schema_compatibility: Literal["BACKWARD", "BACKWARD_TRANSITIVE", "FORWARD", "FORWARD_TRANSITIVE", "FULL",
                                  "FULL_TRANSITIVE", "NONE"] = setting(
        "BACKWARD", "the compatibility rule the registry checks each new schema version of a subject against "
        "(Confluent's names; BACKWARD: a reader of the new version reads data of the one before)",
        readers="stack, setup job")

    model_name: str = setting("policy", "served model name at vLLM and in spans", readers="proxy, stack, main job")
    model: str = setting("smollm2-135m", "the base policy, one of spanrl/core/model.py's MODELS (`smollm2-135m` | "
                         "`qwen2.5-coder-0.5b`): the cache directory of its converted weights, vLLM's chat "
                         "template and tool-call parser (unless set); `make bootstrap` prepares it",
                         readers="stack, trainer, reloader, model")
    base_model_dir: Path | None = setting(None, "directory of the base model (safetensors); unset: the chosen "
                                          "model converted in the cache", readers="stack, trainer, reloader, model")
    run: str = setting("default", "the run's name (checkpoints, tracking, logs)",
                       readers="trainer, reloader, cli, eval, dashboard, chaos, main job")
    seed: int | None = setting(0, "the run seed: every rollout's sampling seed derives from it, the task, the "
                               "rollout's index in its group, the attempt and the call (producers/seeding.py); "
                               "the trainer's torch seed defaults to it. `none` (or empty): unseeded sampling",
                               readers="runner, trainer, main job")
    recipe: str = setting("", "a named trainer recipe (spanrl/core/recipes.py: `default`, the measured one, "
                          "is TrainerConfig's own defaults; `qwen05b-lora`, `qwen05b-lora-tree`, `plain`): its "
                          "values are the trainer's, a `SPANRL_TRAINER_*` variable still wins field by field; "
                          "empty: `default`",
                          readers="trainer, demo, study")
    vllm_tool_call_parser: str | None = setting(None, "vLLM's `--tool-call-parser` (with "
                                                "`--enable-auto-tool-choice`); empty: no parser (`tools` get 400)",
                                                readers="stack", shown="the model's (spanrl/core/model.py)")
    vllm_chat_template: str | None = setting(None, "vLLM's `--chat-template` (relative paths from the repository "
                                             "root); empty: the model's own template", readers="stack",
                                             shown="the model's choice (spanrl/core/model.py)")
    rollout_temperature: float | None = setting(
        None, "the sampling temperature of every training call: the proxy sets it on each call of a training or "
        "production route (an evaluation route keeps its own) and refuses one that also truncates or biases the "
        "distribution (`top_p`, `top_k`, `min_p`, penalties, `logit_bias`, `min_tokens`, `bad_words`, "
        "`allowed_token_ids`: 400 `untrainable_sampling`); vLLM "
        "returns the log-probs of the distribution it sampled from (`--logprobs-mode processed_logprobs`) and the "
        "trainer divides its logits by the same temperature, for the policy and the reference (trainer/losses.py "
        "`tempered`), so the importance ratio compares like with like. A replay must use the run's value. "
        "Unset (`none`): every call keeps the agent's own temperature and vLLM's log-probs are of the raw logits, "
        "which the trainer reads at temperature 1 (every example agent samples at 1.0)",
        readers="proxy, stack, trainer")

    auth: str = setting("on", "`on`: every HTTP route but the health checks needs a credential, the agent token "
                        "(LLM calls, traces, rewards, rollout ends, status reads) or the administrator token "
                        "(every route, `/admin/*` only it), and the trainer signs checkpoints that the reloader "
                        "verifies; the stack makes the secrets at its first start (`state_dir/secrets`). `open`: "
                        "nothing is checked (a laptop demo; each service says so at start) and refused on a host "
                        "beyond loopback (docs/operations.md, Credentials)",
                        readers="every service, stack, cli")
    auth_token: SecretStr | None = setting(None, "the agent token (bridge, proxy; status reads elsewhere); unset: "
                                           "`SPANRL_AUTH_TOKEN_FILE`, else `state_dir/secrets/agent_token`",
                                           readers="bridge, proxy, runner, instrument, reloader, eval, dashboard")
    auth_token_file: Path | None = setting(None, "a file holding the agent token (when `SPANRL_AUTH_TOKEN` is unset)",
                                           readers="bridge, proxy, runner, instrument, reloader, eval, dashboard")
    admin_token: SecretStr | None = setting(None, "the administrator token (every route; `/admin/*` and the "
                                            "dashboard only it); unset: `state_dir/secrets/admin_token`",
                                            readers="bridge, proxy, trainer, reloader, dashboard, eval, main job, "
                                            "chaos, admin helpers")
    checkpoint_key_file: Path | None = setting(None, "the key the trainer signs checkpoint manifests with and the "
                                               "reloader verifies them with (HMAC-SHA256); only they read it",
                                               readers="trainer, reloader", shown="`state_dir/secrets/checkpoint_key`")
    bridge_max_inflight_bytes: int = setting(64 << 20, "bytes of encoded records the bridge holds waiting for "
                                             "Kafka's acks; a request that would go over gets 503 `buffer_full`",
                                             unit="bytes", readers="bridge")
    kafka_send_timeout_s: float = setting(15.0, "how long a producer waits for Kafka's acks before answering 503 "
                                          "`kafka_unavailable`", unit="s", readers="bridge, proxy, runner")
    tracker: str = setting("tensorboard", "experiment tracking of the trainer, the main job and `spanrl eval`: "
                           "tensorboard | mlflow | wandb (offline) | none (trainer/tracking.py)",
                           readers="trainer, main job, eval")
    tracker_dir: Path | None = setting(None, "where tracking logs go (`RUN/trainer`, `RUN/main_job`, `eval/NAME` "
                                       "below it)", readers="trainer, main job, eval", shown="`state_dir/tensorboard`")

    @field_validator("recipe")
    @classmethod
    def _known_recipe(cls, value: str) -> str:
        from spanrl.core.recipes import get_recipe

        value = value.strip()
        if value:
            get_recipe(value)  # ValueError naming the known recipes
        return value

    @field_validator("seed", mode="before")
    @classmethod
    def _seed_none(cls, value):
        """``none`` / ``null`` / empty: no run seed."""
        return _none_word(value)

    @field_validator("rollout_temperature", mode="before")
    @classmethod
    def _rollout_temperature(cls, value):
        """``none`` / ``null`` / empty: unset; else a finite temperature > 0 (greedy calls have no
        sampling distribution to take an importance ratio against)."""
        value = _none_word(value)
        if value is not None and not 0 < float(value) < float("inf"):
            raise ValueError(f"must be a finite temperature > 0 (unset: the agent's own), got {value}")
        return value

    @model_validator(mode="after")
    def _model_defaults(self) -> "Settings":
        """An unknown ``model`` is an error listing the known ones; the chat template and the
        tool-call parser left unset are the model's."""
        from spanrl.core.model import model_spec

        spec = model_spec(self.model)
        if self.vllm_tool_call_parser is None:
            self.vllm_tool_call_parser = spec.tool_call_parser
        if self.vllm_chat_template is None:
            self.vllm_chat_template = spec.chat_template
        return self

    @field_validator("auth")
    @classmethod
    def _auth_mode(cls, value: str) -> str:
        value = value.strip().lower()
        if value not in ("on", "open"):
            raise ValueError(f"must be `on` or `open`, got {value!r}")
        return value

    @model_validator(mode="after")
    def _read_auth_token(self) -> "Settings":
        """Each token: the variable, else its file (the agent's ``SPANRL_AUTH_TOKEN_FILE``, which
        must hold one), else the stack's ``state_dir/secrets``; empty means unset. Open mode on
        a host beyond loopback is refused (anyone on the network could train the model)."""
        from spanrl.core import credentials
        from spanrl.core.edge import is_loopback

        if self.auth == "open" and not is_loopback(self.host):
            raise ValueError(f"SPANRL_AUTH=open with SPANRL_HOST={self.host}: a service bound beyond loopback "
                             "needs auth on (SPANRL_AUTH=on and its tokens, docs/operations.md)")
        if self.auth_token is not None and not self.auth_token.get_secret_value().strip():
            self.auth_token = None
        if self.auth_token is None and self.auth_token_file is not None:
            token = self.auth_token_file.read_text().strip()
            if not token:
                raise ValueError(f"SPANRL_AUTH_TOKEN_FILE {self.auth_token_file} is empty")
            self.auth_token = SecretStr(token)
        if self.admin_token is not None and not self.admin_token.get_secret_value().strip():
            self.admin_token = None
        self.reload_secrets()
        return self

    def reload_secrets(self) -> None:
        """Fill the tokens still unset from the stack's ``state_dir/secrets`` (at start-up, and
        once ``spanrl stack up`` has made them)."""
        from spanrl.core import credentials

        for field, name in (("auth_token", credentials.AGENT_TOKEN), ("admin_token", credentials.ADMIN_TOKEN)):
            if getattr(self, field) is None:
                found = credentials.read_secret(self.state_dir, name)
                if found is not None:
                    setattr(self, field, SecretStr(found))

    def credentials(self):
        """What a service accepts (spanrl/core/edge.py ``Credentials``); None in open mode (the
        caller says so loudly: ``spanrl.core.edge.service_credentials``). Only an agent token
        (``SPANRL_AUTH_TOKEN`` as before the administrator token existed): that one token for
        both roles. Auth on without a token raises :class:`AuthNotConfigured` naming the ways to
        provide them."""
        from spanrl.core.edge import Credentials, as_credentials, token_value

        if self.auth == "open":
            return None
        agent, admin = token_value(self.auth_token), token_value(self.admin_token)
        if agent is None:
            raise AuthNotConfigured(f"auth is on (SPANRL_AUTH=on) but no token is set and {self.state_dir / 'secrets'} "
                                    "holds none: start the stack once (`spanrl stack up` makes the secrets), set "
                                    "SPANRL_AUTH_TOKEN and SPANRL_ADMIN_TOKEN, or run open for a laptop demo with "
                                    "SPANRL_AUTH=open")
        return as_credentials(agent) if admin is None else Credentials(agent=(agent,), admin=admin)

    def checkpoint_key(self) -> bytes | None:
        """The checkpoint signing key (``checkpoint_key_file``, else
        ``state_dir/secrets/checkpoint_key``; only the trainer and the reloader read it), None
        when there is none."""
        from spanrl.core import credentials

        if self.checkpoint_key_file is not None:
            key = credentials.read_file(self.checkpoint_key_file)
        else:
            key = credentials.read_secret(self.state_dir, credentials.CHECKPOINT_KEY)
        return key.encode() if key is not None else None

    @field_validator("kafka_brokers")
    @classmethod
    def _one_or_a_quorum(cls, value: int) -> int:
        if value == 2 or value < 1:
            raise ValueError(f"must be 1, or >= 3 (replication factor 3 with min.insync.replicas 2 needs three "
                             f"brokers to survive the loss of one), got {value}")
        return value

    @field_validator("stream_workers", "bridge_replicas")
    @classmethod
    def _at_least_one(cls, value: int) -> int:
        if value < 1:
            raise ValueError(f"must be at least 1, got {value}")
        return value

    @property
    def faust_web_ports(self) -> list[int]:
        """The stack's stream workers' web ports (worker i at ``faust_web_port + 100 (i - 1)``)."""
        return replica_ports(self.faust_web_port, self.stream_workers)

    @property
    def bridge_ports(self) -> list[int]:
        """The stack's bridges' OTLP/HTTP ports (bridge i at ``bridge_port + 100 (i - 1)``)."""
        return replica_ports(self.bridge_port, self.bridge_replicas)

    @property
    def bridge_grpc_ports(self) -> list[int]:
        """The stack's bridges' OTLP/gRPC ports, in bridge order (all 0 when gRPC is off)."""
        return replica_ports(self.bridge_grpc_port, self.bridge_replicas) if self.bridge_grpc_port else [0] * self.bridge_replicas

    @property
    def bridge_urls(self) -> list[str]:
        """Every bridge's HTTP root, in order (the first is :attr:`bridge_url`)."""
        return [f"http://{self.host}:{p}" for p in self.bridge_ports]

    @property
    def kafka_ports(self) -> list[int]:
        """The stack's brokers' client ports (broker i at ``kafka_port + 100 (i - 1)``)."""
        return replica_ports(self.kafka_port, self.kafka_brokers)

    @property
    def kafka_controller_ports(self) -> list[int]:
        """The stack's brokers' KRaft controller ports, in node order."""
        return replica_ports(self.kafka_controller_port, self.kafka_brokers)

    @property
    def kafka_replication_factor(self) -> int:
        """Replicas of each topic the stack creates: 1 on one broker, 3 on a cluster."""
        return default_replication(self.kafka_brokers)

    @property
    def kafka_bootstrap(self) -> str:
        return self.kafka_bootstrap_servers or ",".join(f"{self.host}:{p}" for p in self.kafka_ports)

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
    def schema_registry_url(self) -> str:
        """The root of the registry's Confluent-compatible API (what kcat's ``-r`` and
        confluent-kafka's ``SchemaRegistryClient`` take)."""
        return (self.schema_registry_address or
                f"http://{self.host}:{self.schema_registry_port}/apis/ccompat/v7").rstrip("/")

    @property
    def model_dir(self) -> Path:
        from spanrl.core.model import model_spec

        return self.base_model_dir or (self.cache_dir / "models" / model_spec(self.model).dir_name)


class TopicSettings(Section):
    TITLE: ClassVar[str] = "Topics (`TopicSettings`)"

    rollout_partitions: int = setting(4, "partitions of the rollout-keyed topics (and of tasks, transitions, the "
                                      "stream app's tables and tick topics); the same in every process of a "
                                      "deployment, at least the number of Faust workers; fixed once the topics "
                                      "exist", readers="every process (schemas/topics.py)")
    topic_prefix: str = setting("", "prefix of every topic name a producer or the dashboard uses "
                                "(`--topic-prefix`); empty: none",
                                readers="bridge, proxy, dashboard, producers/kafka.py")


class ProducerSettings(Section):
    TITLE: ClassVar[str] = "Producers (`ProducerSettings`)"

    bridge_max_body_bytes: int = setting(8 << 20, "largest request body the bridge takes (`--max-body-bytes`)",
                                         unit="bytes", readers="bridge")
    proxy_max_body_bytes: int = setting(16 << 20, "largest request body the proxy takes (413 `body_too_large`)",
                                        unit="bytes", readers="proxy")
    policy_version: int = setting(0, "the proxy's policy-version label until the reloader answers "
                                  "(`--policy-version`)", readers="proxy")
    # issue 55: records that outlive the model
    capture_messages: bool = setting(True, "each proxy call also records the messages the client sent and got and "
                                     "the request's tools and options (span v2 `llm.input_messages` / "
                                     "`output_messages` / `request`); false: token ids and the tokenizer's identity "
                                     "only, and then no new reward can read the text, no export has `messages` and "
                                     "no other model can be trained from these calls (docs/replay.md)",
                                     readers="proxy")
    proxy_rollout_idle_s: float = setting(1800.0, "how long the proxy keeps an attempt's sequence counter after "
                                          "its last call; longer than `SPANRL_ROLLOUT_TIMEOUT_S` and "
                                          "`SPANRL_PRODUCTION_IDLE_S`, after which the stream job has ended the "
                                          "attempt", unit="s", readers="proxy")

    @field_validator("proxy_rollout_idle_s")
    @classmethod
    def _positive_idle(cls, value: float) -> float:
        if not value > 0:
            raise ValueError(f"must be > 0 s (an attempt's counter outlives its last call this long), got {value}")
        return value


def _falsy_off(value):
    """The stream job's switches: ``0`` / ``false`` / ``no`` / ``off`` (any case) are false,
    any other text true (as the worker read them before the settings system)."""
    if isinstance(value, str):
        return value.strip().lower() not in ("0", "false", "no", "off")
    return value


class StreamSettings(Section):
    TITLE: ClassVar[str] = "Stream job (`StreamSettings`, stream_jobs/app.py `StreamConfig`)"

    stream_app_id: str = setting("spanrl-stream", "consumer group and state of the Faust app; a replay uses a new one",
                                 readers="stream, dashboard")
    spans_topic: str = setting(default_factory=_topic("SPANS"), doc="input topic of spans", readers="stream")
    rewards_topic: str = setting(default_factory=_topic("REWARDS"), doc="input topic of rewards", readers="stream")
    rollouts_topic: str = setting(default_factory=_topic("ROLLOUTS"), doc="input topic of rollout lifecycle events",
                                  readers="stream")
    transitions_topic: str = setting(default_factory=_topic("TRANSITIONS"), doc="output topic of transitions, e.g. "
                                     "`derived(TRANSITIONS, \"replay1\").name`", readers="stream")
    samples_topic: str = setting(default_factory=_topic("SAMPLES"), doc="output topic of samples", readers="stream")
    dead_letter_topic: str = setting(default_factory=_topic("DEAD_LETTER"), doc="output topic of dead letters",
                                     readers="stream")
    call_accounts_topic: str = setting(default_factory=_topic("CALL_ACCOUNTS"), doc="one record per ended attempt: "
                                       "its calls' agents, trained or not", readers="stream")
    orphan_spans_topic: str = setting(default_factory=_topic("ORPHAN_SPANS"), doc="spans without a rollout id (key "
                                      "trace_id); a worker on private topics names its own", readers="stream")
    stream_join_traces: bool = setting(True, "run the trace join (agent `join`, trace links); `0`/`false`/`no`/`off`: "
                                       "off (a replay: what joined is on spans already)", readers="stream")
    orphan_timeout_s: float = setting(300.0, "how long a span without rollout id waits for a proxy call of its "
                                      "trace; longer than the worker may lag behind `spans` (after a restart the "
                                      "links come from its backlog)",
                                      unit="s", readers="stream")
    credit_rule: str = setting("identical", "credit per call: `identical`, `scaled:<f>`, `discounted:<γ>`, "
                               "`return_to_go:<γ>`", readers="stream")
    air_rules: str = setting("", "AIR: intermediate rewards from span facts, `FACT:REWARD,...`, FACT in `tool_error "
                             "tool_ok exception timeout verdict_pass verdict_fail`; the first matching rule per span "
                             "(stream_jobs/air.py); empty: none", readers="stream")
    train_agents: str = setting("", "whose calls train: comma-separated agent names, or `re:EXPR` (a whole-name "
                                "regular expression); empty: every call",
                                readers="stream, cli")
    reward_timeout_s: float = setting(60.0, "when an attempt without a final reward parks (or is dead-lettered)",
                                      unit="s", readers="stream")
    reward_window_s: float = setting(7 * 24 * 3600.0, "how long after its end a parked attempt takes a final reward "
                                     "(also how long a short group takes late members); ≤ the reward timeout: no "
                                     "parking", unit="s", readers="stream")
    group_timeout_s: float = setting(120.0, "when a group closes with the rollouts that arrived", unit="s",
                                     readers="stream, replay")
    rollout_timeout_s: float = setting(900.0, "when an attempt without a terminal event is dead-lettered", unit="s",
                                       readers="stream")
    settle_s: float = setting(2.0, "fallback wait after terminal status and final reward (events without "
                              "`inputs_acked`)", unit="s", readers="stream")
    production_idle_s: float = setting(300.0, "a production rollout with no input this long ends "
                                       "(`assembly.production_end`)", unit="s", readers="stream")
    stream_retain_s: float = setting(3600.0, "how long finished-rollout markers stay", unit="s", readers="stream")
    stream_retain_max: int = setting(10000, "finished states each table keeps per partition (rollouts, tasks "
                                     "without an open group); beyond it the oldest go, also before "
                                     "`SPANRL_STREAM_RETAIN_S`", readers="stream")
    stream_tick_s: float = setting(0.5, "tick period (timeouts are evaluated on ticks)", unit="s", readers="stream")
    stream_commit_interval_s: float = setting(0.5, "Faust's broker commit interval (outputs become visible at "
                                              "commits)", unit="s", readers="stream")
    stream_session_timeout_s: float = setting(60.0, "Faust's broker session time-out: a worker that stops "
                                              "heartbeating (SIGKILL) keeps its partitions this long before a "
                                              "restarted or surviving worker takes them over; Kafka accepts 6-1800 "
                                              "(group.min/max.session.timeout.ms); the test stack and `make chaos` "
                                              "use 10", unit="s", readers="stream")
    stream_linger_s: float = setting(0.02, "producer linger: changelog writes and outputs are batched this long",
                                     unit="s", readers="stream")
    claim_retry_s: float = setting(30.0, "how long an unreachable MinIO is retried before `claim_unresolved`",
                                   unit="s", readers="stream")
    stream_replication_factor: int = setting(0, "replication of the topics Faust creates (changelogs, ticks, trace "
                                             "links); 0: the stack's (1 on one broker, 3 with `SPANRL_KAFKA_BROKERS` "
                                             ">= 3); 3 on infra/deploy/'s cluster", readers="stream")

    @field_validator("stream_join_traces", mode="before")
    @classmethod
    def _switch(cls, value):
        return _falsy_off(value)

    @field_validator("stream_session_timeout_s")
    @classmethod
    def _broker_accepts(cls, value: float) -> float:
        # Kafka's group coordinator refuses a JoinGroup outside [group.min.session.timeout.ms,
        # group.max.session.timeout.ms] (defaults 6 s and 30 min): the worker would never join
        if not 6.0 <= value <= 1800.0:
            raise ValueError(f"must be within 6-1800 s (Kafka's default session time-out bounds), got {value}")
        return value

    @field_validator("stream_retain_max")
    @classmethod
    def _at_least_one(cls, value: int) -> int:
        if value < 1:
            raise ValueError(f"must be >= 1 (finished states kept per partition), got {value}")
        return value


class DashboardSettings(Section):
    TITLE: ClassVar[str] = "Dashboard (`DashboardSettings`)"

    dashboard_eval_dirs: str = setting("results/eval:results", "where the dashboard looks for `spanrl eval` results "
                                       "(`os.pathsep`-separated)", readers="dashboard")


class StackSettings(Section):
    TITLE: ClassVar[str] = "Local stack (`StackSettings`, infra/stack.py)"

    vllm_threads: str = setting("2", "vLLM's `OMP_NUM_THREADS`", readers="stack")
    #: a name below SPANRL_TRAINER_ that is the stack's, not the trainer's (TrainerConfig ignores it)
    trainer_threads: str = setting("2", "the trainer's `OMP_NUM_THREADS`", readers="stack")


#: where the stack's trainer starts when ``SPANRL_TRAINER_START`` is unset (a new run trains
#: on samples produced from now on, not on the samples of earlier runs kept in the topic);
#: the trainer's own default is :class:`TrainerConfig` ``start``
STACK_TRAINER_START = "latest"


class DeploymentSettings(Section):
    """Variables the multi-machine deployment files read (Compose interpolation, the
    OpenTelemetry Collector's config); no Python code reads them. Declared so that a shell
    that sets them can start services."""

    TITLE: ClassVar[str] = "Deployment files (`DeploymentSettings`; no Python reader)"

    bridges: int = setting(2, "bridge replicas", readers="infra/deploy/compose.yaml")
    workers: int = setting(3, "Faust worker replicas (≤ `SPANRL_ROLLOUT_PARTITIONS`)",
                           readers="infra/deploy/compose.yaml")
    image: str = setting("spanrl:0.1.0", "the services' image", readers="infra/deploy/compose.yaml")
    minio_image: str = setting("spanrl-minio:0.1.0", "the MinIO image", readers="infra/deploy/compose.yaml")
    policy_image: str = setting("spanrl-policy:0.1.0", "the vLLM + reloader image", readers="infra/deploy/compose.yaml")
    bridge_url: str = setting("", "the bridge's HTTP root the collector exports to, e.g. http://127.0.0.1:14318",
                              readers="infra/otelcol/collector.yaml")


class TrainerConfig(Section):
    """Trainer knobs; each can be set as ``SPANRL_TRAINER_<FIELD>``."""

    model_config = SettingsConfigDict(env_prefix="SPANRL_TRAINER_", extra="ignore")
    TITLE: ClassVar[str] = "Trainer (`TrainerConfig`, trainer/train.py)"

    @classmethod
    def settings_customise_sources(cls, settings_cls, init_settings, env_settings, dotenv_settings,
                                   file_secret_settings):
        """The sections' sources, then the recipe ``SPANRL_RECIPE`` names (the lowest of them)."""
        return (*super().settings_customise_sources(settings_cls, init_settings, env_settings, dotenv_settings,
                                                    file_secret_settings), _RecipeSource(settings_cls))

    run: str | None = setting(None, "run name", readers="trainer", shown="`SPANRL_RUN`")
    base_dir: Path | None = setting(None, "the base model's directory", readers="trainer",
                                    shown="the stack's model directory")
    samples_topic: str = setting(default_factory=_topic("SAMPLES"), doc="topic the trainer consumes", readers="trainer")
    checkpoints_topic: str = setting(default_factory=_topic("CHECKPOINTS"), doc="topic of checkpoint announcements",
                                     readers="trainer")
    algorithm: str = setting("grpo", "grpo: each sample's group advantage; reinforce_pp: batch-normalised rewards",
                             readers="trainer")
    singleton_advantage: str = setting("batch", "grpo, a sample of a group of one: `batch` = the REINFORCE++ batch "
                                       "baseline, `zero` = GRPO's 0 (such samples do not train)", readers="trainer")
    lr: float = recipe_setting("lr", "learning rate", readers="trainer")
    weight_decay: float = setting(0.0, "AdamW weight decay", readers="trainer")
    clip_eps: float = setting(0.2, "PPO clip range", readers="trainer")
    loss_agg: str = recipe_setting("loss_agg", "how tokens are weighed in the loss: token_mean | sequence_mean | "
                                   "per_rollout_mean (losses.sequence_loss_weights)", readers="trainer")
    advantage_std_scale: bool = recipe_setting(
        "advantage_std_scale",
        "grpo: divide the group baseline's residual by the group's std (GRPO); false: Dr. GRPO's "
        "`R - group_mean`", readers="trainer")
    drop_zero_variance: bool = recipe_setting(
        "drop_zero_variance",
        "leave out samples of groups whose rollouts all got the same return (DAPO's dynamic-sampling filter)",
        readers="trainer")
    negative_advantage_weight: float = setting(1.0, "scale of negative advantages (weighted REINFORCE): 1 = the plain "
                                               "objective, 0 = positive samples only", readers="trainer")
    prefix_tree_advantage: bool = setting(False, "grpo: per-token advantages from the prefix tree of each group's "
                                          "completions of one prompt (losses.prefix_tree_advantages, TreeRL's global "
                                          "advantage)", readers="trainer")
    self_imitation_updates: int = recipe_setting(
        "self_imitation_updates",
        "> 0: the positive-advantage samples of the last this many updates are trained again in each update, "
        "against their own behaviour log-probs (trainer/self_imitation.py, Self-Imitation Learning); in memory "
        "only: a restarted trainer starts with none; 0: off", unit="updates", readers="trainer")
    self_imitation_weight: float = recipe_setting(
        "self_imitation_weight",
        "scale of a replayed sample's advantage (Self-Imitation Learning's beta^sil): 1 = trained as its update "
        "trained it; read only when self_imitation_updates > 0", readers="trainer")
    self_imitation_loss: str = setting("clipped", "how replayed samples are trained: clipped (the update's PPO-clipped "
                                       "loss against their own behaviour log-probs) | sil (Self-Imitation Learning's "
                                       "unclipped -log pi * A+, losses.self_imitation_loss: no clip ends the push); "
                                       "read only when self_imitation_updates > 0", readers="trainer")
    prefix_merge: bool = setting(True, "train the calls of one attempt whose prompt starts with the previous call's "
                                 "prompt + completion as one row, each token with its own call's advantage, "
                                 "behaviour log-prob and loss weight (trainer/prefix_merge.py, Agent Lightning's "
                                 "trajectory aggregation): the same loss with fewer tokens forwarded (0.56x for "
                                 "the math agent); false: one row per call", readers="trainer")
    tree_packing: bool = setting(False, "forward each micro-batch's rows as one packed prefix tree, shared prefixes "
                                 "(system prompt, tools, a group's question) once, each token attending only to "
                                 "its own row (trainer/tree_pack.py, AReaL's tree training): the same log-probs and "
                                 "gradients with fewer tokens forwarded; micro_batch_tokens then counts packed "
                                 "tokens; needs logprob_chunk > 0", readers="trainer")
    kl_coef: float = recipe_setting(
        "kl_coef",
        "weight of the k3 KL to the reference policy (a frozen copy of the base weights); 0: off, no reference "
        "model is loaded", readers="trainer")
    mini_batches: int = recipe_setting(
        "mini_batches",
        "optimizer steps per update: the update's samples in content order cut into this many mini-batches, one "
        "step each, every PPO epoch", readers="trainer")
    batching: str = recipe_setting(
        "batching",
        "when an update happens: `stream` (min_batch samples buffered, or idle_flush_s without new ones; "
        "max_batch at most), `barrier` (only on `POST /admin/train`) or `groups` (update_groups complete groups "
        "buffered, each group's samples in one update: no driver, no clock; trainer/batching.py `group_cut`); "
        "the main job asks for its updates (barrier) whatever this says", readers="trainer")
    update_groups: int = recipe_setting(
        "update_groups",
        "`groups` batching: complete GRPO groups per update", unit="groups", readers="trainer")
    grad_clip: float = setting(1.0, "gradient clipping norm", readers="trainer")
    ppo_epochs: int = setting(1, "passes over an update's samples", readers="trainer")
    min_batch: int = setting(16, "samples that start a `stream` update", unit="samples", readers="trainer")
    max_batch: int = setting(64, "most samples in one update", unit="samples", readers="trainer")
    idle_flush_s: float = setting(10.0, "a `stream` update of what is buffered after this long without new samples",
                                  unit="s", readers="trainer")
    ranks: int = setting(1, "data-parallel DeepSpeed ranks of the trainer on this machine: > 1 starts them through "
                         "DeepSpeed's launcher; rank 0 reads the samples and publishes, every rank trains its share "
                         "of each update (trainer/ranks.py)", unit="processes", readers="trainer")
    zero_stage: int | None = setting(None, "DeepSpeed ZeRO stage: 0 (nothing partitioned: on one rank the least "
                                     "memory, no ZeRO copies of weights and gradients), 2 (optimizer states and "
                                     "gradients partitioned over the ranks, each rank holds the whole weights) or 3 "
                                     "(the weights too: gathered for each checkpoint; needs logprob_chunk 0 and no "
                                     "LoRA)", readers="trainer", shown="0 with one rank, 2 with more")
    micro_batch: int = setting(8, "at most this many sequences per micro-batch ...", unit="sequences",
                               readers="trainer")
    micro_batch_tokens: int = setting(2048, "... and at most this many padded tokens", unit="tokens", readers="trainer")
    activation_checkpointing: bool = setting(True, "recompute each decoder layer's activations in backward instead "
                                             "of keeping them (trainer/README.md, \"Memory\")", readers="trainer")
    lora_rank: int = setting(0, "> 0: train rank-`lora_rank` LoRA adapters on `lora_target_modules` with every base "
                             "weight frozen (trainer/lora.py); 0: full fine-tuning", readers="trainer")
    lora_alpha: float = setting(32.0, "the adapter's output is scaled by lora_alpha / lora_rank", readers="trainer")
    lora_dropout: float = setting(0.0, "dropout on each adapter's input while training", readers="trainer")
    lora_target_modules: str = setting("q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj",
                                       "comma-separated module names that get adapters (matched at the end of a "
                                       "module's path)", readers="trainer")
    logprob_chunk: int = setting(256, "completion positions whose log-probs are computed at once "
                                 "(losses.chunked_token_logprobs; ~150 MB of logits at a time for SmolLM2); 0: the "
                                 "full logits of a micro-batch's completion window", unit="tokens", readers="trainer")
    max_tokens: int = setting(4096, "longest sample (prompt + completion) trained", unit="tokens", readers="trainer")
    checkpoint_every: int = setting(1, "updates per checkpoint", unit="updates", readers="trainer")
    keep_local: int = setting(2, "local checkpoint copies kept per run (0: all)", readers="trainer")
    keep_published: int = setting(0, "published versions whose weights stay in MinIO (0: all; older ones keep their "
                                  "manifest)", readers="trainer")
    init_from: str | None = setting(None, "`RUN:VERSION`: a new run starts from that checkpoint (replay)",
                                    readers="trainer")
    start: str = setting("earliest", "where a run with no checkpoint starts reading samples: earliest | latest "
                         "(the stack's trainer: `latest` unless set)", readers="trainer, stack")
    max_updates: int | None = setting(None, "stop after this many updates (tests, benchmarks); unset: never",
                                      readers="trainer")
    log_path: Path | None = setting(None, "JSON lines of updates", readers="trainer",
                                    shown="`state_dir/trainer-<run>.jsonl`")
    http: bool = setting(True, "serve the HTTP status and admin", readers="trainer")
    seed: int | None = setting(None, "torch's seed", readers="trainer", shown="`SPANRL_SEED`, else 0")
    max_staleness: int = setting(4, "the largest lag (trained version minus a sample's behaviour version) trained "
                                 "as usual (< 0: no bound); beyond it `stale_policy`", unit="versions",
                                 readers="trainer")
    stale_policy: str = setting("refuse", "a sample beyond the staleness bound: `refuse` (dead letter "
                                "`stale_sample`) or `keep` (trained with the ratio capped at `ratio_cap`)",
                                readers="trainer, replay")
    ratio_cap: float = setting(3.0, "dual-clip cap of the importance ratio (`stale_policy=keep`)", readers="trainer")
    dead_letter_topic: str = setting(default_factory=_topic("DEAD_LETTER"), doc="topic of refused samples",
                                     readers="trainer")

    @model_validator(mode="after")
    def _zero_stage_for_the_ranks(self) -> "TrainerConfig":
        """Unset ``zero_stage``: 0 with one rank (trainer/README.md, "Memory": ~940 MiB less
        than ZeRO-2 for SmolLM2), 2 with more (the optimizer states sharded over the ranks)."""
        if self.zero_stage is None:
            self.zero_stage = 0 if self.ranks == 1 else 2
        return self


class ReloaderConfig(Section):
    """Reloader knobs; each can be set as ``SPANRL_RELOADER_<FIELD>``."""

    model_config = SettingsConfigDict(env_prefix="SPANRL_RELOADER_", extra="ignore")
    TITLE: ClassVar[str] = "Reloader (`ReloaderConfig`, trainer/reloader.py)"

    run: str | None = setting(None, "run name", readers="reloader", shown="`SPANRL_RUN`")
    checkpoints_topic: str = setting(default_factory=_topic("CHECKPOINTS"), doc="topic of checkpoint announcements",
                                     readers="reloader")
    start: str = setting("latest", "latest: reload the newest existing announcement of the run, then follow; end: "
                         "only announcements made after start; beginning: replay all (oldest first)",
                         readers="reloader")
    from_version: int = setting(1, "ignore announcements below this version", readers="reloader")
    pause_mode: str = setting("wait", "vLLM /pause mode: wait (finish in-flight), abort, keep", readers="reloader")
    vllm_url: str | None = setting(None, "vLLM's URL", readers="reloader",
                                   shown="`http://SPANRL_HOST:SPANRL_VLLM_PORT`")
    proxy_url: str | None = setting(None, "the proxy's URL", readers="reloader",
                                    shown="`http://SPANRL_HOST:SPANRL_PROXY_PORT`")
    reload_timeout_s: float = setting(600.0, "how long one vLLM reload may take", unit="s", readers="reloader")
    max_announcements: int | None = setting(None, "stop after handling this many (tests); unset: never",
                                            readers="reloader")
    watch_interval_s: float = setting(1.0, "poll vLLM /health this often; 0: do not watch", unit="s",
                                      readers="reloader")
    http: bool = setting(True, "serve the HTTP status and admin", readers="reloader")
    keep_local: int = setting(2, "local checkpoint copies kept per run (0: all); MinIO keeps every version",
                              readers="reloader")
    gate: bool = setting(False, "release gate (trainer/gate.py): evaluate each new checkpoint on held-out tasks "
                         "before it becomes the served policy", readers="reloader")
    gate_agent: str = setting("examples.math_agent.agent:math_agent", "the gate's agent: a runner callable or an "
                              "AgentSpec (`module:attribute`)", readers="reloader")
    gate_evaluation: str = setting("spanrl.infra.evaluation:gate_rewards",
                                   "what runs the gate's held-out episodes (`module:attribute`, "
                                   "trainer/gate.py `GateEvaluation`): the control plane's evaluator",
                                   readers="reloader")
    gate_task_set: str = setting("arith_word", "the gate's task set: a math task set or `AGENT:SPLIT` (AGENT an "
                                 "AgentSpec's `module:attribute` or math, sql, rag)", readers="reloader")
    gate_seed: int = setting(1000, "the held-out seed; items [gate_offset, gate_offset + gate_tasks)",
                             readers="reloader")
    gate_offset: int = setting(200, "past the 200 the main job reports, so serving decisions never saw those",
                               readers="reloader")
    gate_tasks: int = setting(40, "held-out tasks per evaluation", readers="reloader")
    gate_tolerance: float = setting(0.0, "refuse when worse than the incumbent by more, with 95% confidence",
                                    readers="reloader")
    gate_concurrency: int = setting(8, "rollouts of the gate's evaluation at once", readers="reloader")


#: every section, in the settings reference's order
SECTIONS: tuple[type[Section], ...] = (Settings, TopicSettings, ProducerSettings, StreamSettings, TrainerConfig,
                                       ReloaderConfig, DashboardSettings, StackSettings, DeploymentSettings)


def known_names() -> dict[str, type[Section]]:
    """Every declared variable name -> its section."""
    out: dict[str, type[Section]] = {}
    for section in SECTIONS:
        for name in section.env_names():
            if name in out:
                raise AssertionError(f"{name} is declared by {out[name].__name__} and {section.__name__}")
            out[name] = section
    return out


class UnknownSetting(ValueError):
    """A ``SPANRL_*`` variable no section declares (misspelt, or a setting that is gone)."""

    def __init__(self, names: list[str], closest: dict[str, str | None]):
        self.names, self.closest = names, closest
        parts = [f"{n} (closest known: {closest[n]})" if closest[n] else n for n in names]
        super().__init__(f"unknown setting{'s' if len(names) > 1 else ''} in the environment: {'; '.join(parts)}. "
                         "Every SPANRL_* variable is declared in spanrl/core/settings.py "
                         "(python -m spanrl.core.settings --markdown lists them); unset or correct it")


def closest_name(name: str) -> str | None:
    """The declared variable name closest to ``name`` (difflib), None when nothing is close."""
    best = difflib.get_close_matches(name.upper(), list(known_names()), n=1, cutoff=0.5)
    return best[0] if best else None


def unknown_names(environ: Mapping[str, str] | None = None) -> list[str]:
    """``SPANRL_*`` names in ``environ`` (default: the process environment) no section declares."""
    environ = os.environ if environ is None else environ
    known = known_names()
    return sorted(k for k in environ if k.upper().startswith(PREFIX) and k.upper() not in known)


def check_environment(environ: Mapping[str, str] | None = None) -> None:
    """Raise :class:`UnknownSetting` naming every undeclared ``SPANRL_*`` variable of
    ``environ`` (default: the process environment) and its closest declared name. Each
    service's ``main`` and ``Stack.up`` call it first."""
    unknown = unknown_names(environ)
    if unknown:
        raise UnknownSetting(unknown, {n: closest_name(n) for n in unknown})


def _declared(name: str) -> str:
    if name.upper().startswith(PREFIX) and name.upper() not in known_names():
        raise UnknownSetting([name], {name: closest_name(name)})
    return name


# ---- the process environment: the only reads and writes outside the sections ---------

def env_value(name: str, default: str | None = None) -> str | None:
    """The raw value of the process's variable ``name`` (``default`` when unset): for
    variables that are not spanrl settings (``OMP_NUM_THREADS``, ``MASTER_ADDR``, ...) and for
    passing a declared ``SPANRL_*`` setting through to a child process as the user wrote it.
    A ``SPANRL_*`` name no section declares raises :class:`UnknownSetting`."""
    return os.environ.get(_declared(name), default)


def set_env(name: str, value: str) -> None:
    """Set the process's variable ``name`` (read by this process's later sections and by
    child processes)."""
    os.environ[_declared(name)] = value


def setdefault_env(name: str, value: str) -> str:
    """Set ``name`` unless it is set; its value."""
    return os.environ.setdefault(_declared(name), value)


def update_env(values: Mapping[str, str]) -> None:
    for name, value in values.items():
        set_env(name, value)


def child_env(*overlays: Mapping[str, str] | None) -> dict[str, str]:
    """A child process's environment: this process's, with ``overlays`` applied in order."""
    env = dict(os.environ)
    for overlay in overlays:
        env.update({_declared(k): v for k, v in (overlay or {}).items()})
    return env


def env_with_prefix(prefix: str) -> dict[str, str]:
    """The process's variables whose name starts with ``prefix`` (e.g. ``SPANRL_TRAINER_``)."""
    return {k: v for k, v in os.environ.items() if k.startswith(prefix)}


class AuthNotConfigured(RuntimeError):
    """Auth is on and a service cannot find its tokens."""


@lru_cache(maxsize=1)
def get_settings() -> Settings:
    """The process-wide settings (read once from the environment)."""
    return Settings()


# ---- the settings reference (docs/reference/settings.md) -----------------------------

def _shown_default(section: type[Section], field: str) -> str:
    info = section.model_fields[field]
    extra = info.json_schema_extra or {}
    if extra.get("shown"):
        return extra["shown"]
    value = section.default(field)
    if value is None:
        return "unset"
    if extra.get("recipe"):
        from spanrl.core.recipes import env_text

        return f"`{env_text(value)}` (recipe `{extra['recipe']}`)"
    if isinstance(value, bool):
        return f"`{str(value).lower()}`"
    if isinstance(value, str):
        return f"`{value}`" if value else "empty"
    return f"`{value}`"


def _type_name(annotation) -> str:
    if isinstance(annotation, type):
        return annotation.__name__
    return str(annotation).replace("pathlib.", "").replace("pydantic.types.", "")


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def markdown_table() -> str:
    """The settings reference's table: one table per section, generated from the declarations."""
    lines = []
    for section in SECTIONS:
        lines += [f"**{section.TITLE}**", "", "| variable | type | default | unit | read by | meaning |",
                  "|---|---|---|---|---|---|"]
        for field, info in section.model_fields.items():
            extra = info.json_schema_extra or {}
            cells = [f"`{section.env_name(field)}`", _type_name(info.annotation), _shown_default(section, field),
                     extra.get("unit", ""), extra.get("readers", ""), info.description or ""]
            lines.append("| " + " | ".join(_cell(c) for c in cells) + " |")
        lines.append("")
    return "\n".join(lines).rstrip() + "\n"


TABLE_BEGIN = "<!-- settings table: generated by `python -m spanrl.core.settings --markdown`; do not edit -->"
TABLE_END = "<!-- end of settings table -->"


#: the page that holds the table between :data:`TABLE_BEGIN` and :data:`TABLE_END`
SETTINGS_PAGE = "docs/reference/settings.md"


def page_table(page_text: str) -> str:
    """The part of a page between :data:`TABLE_BEGIN` and :data:`TABLE_END`."""
    start = page_text.index(TABLE_BEGIN) + len(TABLE_BEGIN)
    return page_text[start:page_text.index(TABLE_END)].strip("\n") + "\n"


def write_page(path: Path) -> bool:
    """Put :func:`markdown_table` into the page ``path`` between the markers; True if it changed."""
    text = path.read_text()
    start = text.index(TABLE_BEGIN) + len(TABLE_BEGIN)
    new = text[:start] + "\n" + markdown_table() + text[text.index(TABLE_END):]
    if new != text:
        path.write_text(new)
    return new != text


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description="spanrl's declared settings (every SPANRL_* variable).")
    p.add_argument("--markdown", action="store_true", help="print the settings reference's table")
    p.add_argument("--write", type=Path, metavar="PAGE",
                   help=f"write the table into PAGE between its markers ({SETTINGS_PAGE})")
    p.add_argument("--check", action="store_true", help="fail on an undeclared SPANRL_* variable in the environment")
    a = p.parse_args(argv)
    if a.write:
        print("updated" if write_page(a.write) else "up to date", a.write)
    if a.check:
        check_environment()
    if a.markdown or not (a.write or a.check):
        print(markdown_table(), end="")


if __name__ == "__main__":
    main()
