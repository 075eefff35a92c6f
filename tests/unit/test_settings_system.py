"""The one settings system (spanrl/core/settings.py, issue 22 item 2): every SPANRL_* name declared
once, today's defaults, an undeclared name stops start-up, the settings reference's table is generated, no
other module reads the environment, one DeepSpeed config."""
from __future__ import annotations

import dataclasses
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from spanrl.core import settings as S
from spanrl.core.settings import (DashboardSettings, ProducerSettings, ReloaderConfig, Settings, StackSettings,
                                  StreamSettings, TopicSettings, TrainerConfig, UnknownSetting, check_environment)

ROOT = Path(__file__).resolve().parents[2]

# ---- the unknown-name check --------------------------------------------------------------


def test_a_misspelt_name_is_an_error_naming_it_and_the_closest_known_name():
    with pytest.raises(UnknownSetting) as err:
        check_environment({"SPANRL_TRAINER_LRR": "1e-4", "PATH": "/bin"})
    assert err.value.names == ["SPANRL_TRAINER_LRR"]
    assert err.value.closest == {"SPANRL_TRAINER_LRR": "SPANRL_TRAINER_LR"}
    assert str(err.value).startswith("unknown setting in the environment: SPANRL_TRAINER_LRR "
                                     "(closest known: SPANRL_TRAINER_LR). Every SPANRL_* variable is declared in "
                                     "spanrl/core/settings.py")


def test_every_unknown_name_is_listed_at_once_sorted():
    with pytest.raises(UnknownSetting) as err:
        check_environment({"SPANRL_REWARD_TIMOUT_S": "5", "SPANRL_GROUP_TIMEOUT": "5", "SPANRL_KAFKA_PORT": "1"})
    assert err.value.names == ["SPANRL_GROUP_TIMEOUT", "SPANRL_REWARD_TIMOUT_S"]
    assert err.value.closest == {"SPANRL_GROUP_TIMEOUT": "SPANRL_GROUP_TIMEOUT_S",
                                 "SPANRL_REWARD_TIMOUT_S": "SPANRL_REWARD_TIMEOUT_S"}
    assert "unknown settings in the environment: SPANRL_GROUP_TIMEOUT (closest known: SPANRL_GROUP_TIMEOUT_S); " \
           "SPANRL_REWARD_TIMOUT_S (closest known: SPANRL_REWARD_TIMEOUT_S)" in str(err.value)
    assert isinstance(err.value, ValueError)


def test_nothing_close_names_no_closest():
    with pytest.raises(UnknownSetting) as err:
        check_environment({"SPANRL_ZZZZZZZZZZZZZZZZZZZZZZZZ": "1"})
    assert err.value.closest == {"SPANRL_ZZZZZZZZZZZZZZZZZZZZZZZZ": None}
    assert "closest" not in str(err.value).split(".")[0]


def test_declared_names_and_other_variables_pass():
    check_environment({name: "x" for name in S.known_names()} | {"HOME": "/root", "SPANRL": "x", "XSPANRL_A": "1"})
    check_environment({})


def test_the_example_and_chaos_overrides_are_all_declared():
    from examples.math_agent.main_job import DRIVER_TRAINER_ENV
    from spanrl.infra.chaos import CHAOS_ENV

    check_environment(DRIVER_TRAINER_ENV)
    check_environment(CHAOS_ENV)


def test_overrides_are_built_from_field_names_and_checked():
    from spanrl.infra.chaos import CHAOS_ENV

    assert TrainerConfig.env(lr="5e-5", http=False, max_updates=3) == {
        "SPANRL_TRAINER_LR": "5e-5", "SPANRL_TRAINER_HTTP": "false", "SPANRL_TRAINER_MAX_UPDATES": "3"}
    assert Settings.env(faust_web_port=1234) == {"SPANRL_FAUST_WEB_PORT": "1234"}
    with pytest.raises(UnknownSetting, match=r"SPANRL_TRAINER_LRR \(closest known: SPANRL_TRAINER_LR\)"):
        TrainerConfig.env(lrr="1")
    with pytest.raises(ValueError):  # pydantic's ValidationError: the value does not parse
        TrainerConfig.env(min_batch="twelve")
    with pytest.raises(ValueError, match="None cannot be written"):
        TrainerConfig.env(max_updates=None)
    # today's values, as the dicts were written by hand before
    assert CHAOS_ENV == {
        "SPANRL_REWARD_TIMEOUT_S": "15", "SPANRL_ROLLOUT_TIMEOUT_S": "30", "SPANRL_GROUP_TIMEOUT_S": "30",
        "SPANRL_REWARD_WINDOW_S": "25", "SPANRL_SETTLE_S": "2", "SPANRL_TRAINER_BATCHING": "stream",
        "SPANRL_TRAINER_MIN_BATCH": "12",
        "SPANRL_TRAINER_IDLE_FLUSH_S": "5", "SPANRL_TRAINER_CHECKPOINT_EVERY": "1",
        "SPANRL_TRAINER_KEEP_PUBLISHED": "4", "SPANRL_STREAM_SESSION_TIMEOUT_S": "10"}


def test_each_name_is_declared_once_and_named_prefix_plus_field():
    known = S.known_names()  # raises on a name two sections declare
    assert len(known) == sum(len(section.model_fields) for section in S.SECTIONS) == 161
    assert known["SPANRL_TRAINER_LR"] is TrainerConfig and known["SPANRL_TRAINER_THREADS"] is StackSettings
    assert known["SPANRL_RELOADER_GATE"] is ReloaderConfig and known["SPANRL_RELOADER_PORT"] is Settings
    assert known["SPANRL_ROLLOUT_PARTITIONS"] is TopicSettings and known["SPANRL_STREAM_APP_ID"] is StreamSettings
    for section in S.SECTIONS:
        for field, info in section.model_fields.items():
            assert info.description, f"{section.__name__}.{field} has no description"
            assert (info.json_schema_extra or {}).get("readers"), f"{section.__name__}.{field} names no reader"


def test_the_environment_helpers_refuse_undeclared_spanrl_names(monkeypatch):
    for call in (lambda: S.set_env("SPANRL_TRAINER_LRR", "1"), lambda: S.setdefault_env("SPANRL_RUNN", "x"),
                 lambda: S.env_value("SPANRL_SEEDD"), lambda: S.child_env({"SPANRL_TRAINR_LR": "1"}),
                 lambda: S.update_env({"SPANRL_RUN": "a", "SPANRL_RNU": "b"})):
        with pytest.raises(UnknownSetting):
            call()
    monkeypatch.setenv("SPANRL_SEED", "7")
    assert S.env_value("SPANRL_SEED") == "7" and S.env_value("NO_SUCH_VARIABLE_HERE", "d") == "d"
    env = S.child_env({"A_B": "1"}, None, {"A_B": "2", "SPANRL_RUN": "r"})
    assert (env["A_B"], env["SPANRL_RUN"], env["SPANRL_SEED"]) == ("2", "r", "7")
    assert S.env_with_prefix("SPANRL_SEED") == {"SPANRL_SEED": "7"}


# ---- start-up refuses a misspelt name ----------------------------------------------------

def _nothing_may_start(*_a, **_k):
    raise AssertionError("started although the environment has an undeclared SPANRL_* variable")


def test_stack_up_refuses_before_starting_anything(monkeypatch):
    from spanrl.infra.stack import Stack

    monkeypatch.setattr(Stack, "start", _nothing_may_start)
    monkeypatch.setenv("SPANRL_KAFKA_PROT", "1")
    with pytest.raises(UnknownSetting, match="SPANRL_KAFKA_PROT \\(closest known: SPANRL_KAFKA_PORT\\)"):
        Stack().up()


def test_each_service_main_refuses(monkeypatch):
    import uvicorn

    from spanrl.core import model
    from spanrl.infra import setup_job
    from spanrl.infra.dashboard import app as dashboard
    from spanrl.producers import bridge, proxy
    from spanrl.trainer import reloader

    monkeypatch.setattr(uvicorn, "run", _nothing_may_start)
    monkeypatch.setattr(reloader, "Reloader", _nothing_may_start)
    monkeypatch.setattr(setup_job, "Stack", _nothing_may_start)
    monkeypatch.setenv("SPANRL_TRAINER_MAX_BATCHS", "2")
    for main, argv in ((bridge.main, []), (proxy.main, []), (dashboard.main, []), (reloader.main, []),
                       (setup_job.main, []), (model.main, ["--requirements"])):
        with pytest.raises(UnknownSetting, match=r"SPANRL_TRAINER_MAX_BATCHS \(closest known: "
                                                 r"SPANRL_TRAINER_MAX_BATCH\)"):
            main(argv)


def test_the_trainer_main_refuses(monkeypatch):
    from spanrl.trainer import train

    monkeypatch.setattr(train, "Trainer", _nothing_may_start)
    monkeypatch.setenv("SPANRL_TRAINER_LR_", "1")
    with pytest.raises(UnknownSetting, match="SPANRL_TRAINER_LR_ \\(closest known: SPANRL_TRAINER_LR\\)"):
        train.main([])


def test_the_stream_worker_refuses_at_start():
    """``python -m spanrl.stream_jobs.app worker`` exits before the app is built (a Kafka that
    cannot exist and a private app id in case it did not)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("SPANRL_")}
    env |= {"SPANRL_KAFKA_BOOTSTRAP_SERVERS": "127.0.0.1:1", "SPANRL_STREAM_APP_ID": "unit-never-started",
            "SPANRL_FAUST_WEB_PORT": "1", "SPANRL_SETTLE": "2", "PYTHONPATH": str(ROOT)}
    p = subprocess.run([sys.executable, "-m", "spanrl.stream_jobs.app", "worker"], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=120)
    assert p.returncode != 0
    assert "UnknownSetting: unknown setting in the environment: SPANRL_SETTLE (closest known: SPANRL_SETTLE_S)" \
        in p.stderr


# ---- today's defaults, written once --------------------------------------------------------

def test_stack_wide_defaults():
    s = Settings.from_environ({})
    cache = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "spanrl"
    dump = s.model_dump()
    assert dump.pop("minio_secret_key").get_secret_value() == "spanrl-local-secret"
    # the tokens default to unset; a stack started in this clone fills them from state_dir/secrets
    assert (Settings.default("auth_token"), Settings.default("admin_token")) == (None, None)
    del dump["auth_token"], dump["admin_token"]
    assert dump == {
        'host': '127.0.0.1', 'cache_dir': cache, 'state_dir': Path('.spanrl'), 'kafka_port': 19092,
        'kafka_controller_port': 19093, 'kafka_brokers': 1, 'kafka_version': '4.1.1', 'minio_port': 19000, 'minio_console_port': 19001,
        'minio_access_key': 'spanrl', 'checkpoint_bucket': 'spanrl-checkpoints',
        'payload_bucket': 'spanrl-payloads', 'vllm_port': 18000, 'bridge_port': 14318, 'bridge_grpc_port': 14317,
        'proxy_port': 18080, 'faust_web_port': 16066, 'stream_workers': 1, 'bridge_replicas': 1, 'reloader_port': 18090, 'trainer_port': 18091,
        'kafka_bootstrap_servers': '', 'minio_address': '', 'dashboard_port': 18092, 'dashboard_max_rollouts': 5000,
        'schema_registry_port': 18081, 'schema_registry_address': '', 'schema_registry_version': '3.3.3',
        'schema_compatibility': 'BACKWARD',
        'model_name': 'policy', 'model': 'smollm2-135m', 'base_model_dir': None, 'run': 'default', 'seed': 0, 'recipe': '',
        'vllm_tool_call_parser': 'hermes', 'vllm_chat_template': 'infra/chat_templates/smollm2_tools.jinja',
        'rollout_temperature': None,
        'auth': 'on', 'auth_token_file': None, 'checkpoint_key_file': None, 'bridge_max_inflight_bytes': 67108864,
        'kafka_send_timeout_s': 15.0, 'tracker': 'tensorboard', 'tracker_dir': None}


def test_trainer_defaults():
    from spanrl.trainer import lora, train

    assert train.TrainerConfig is TrainerConfig and train.LOGPROB_CHUNK == 256
    assert lora.DEFAULT_TARGET_MODULES == "q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj"
    assert TrainerConfig.from_environ({}).model_dump() == {
        'run': None, 'base_dir': None, 'samples_topic': 'samples', 'checkpoints_topic': 'checkpoints',
        'algorithm': 'grpo', 'singleton_advantage': 'batch', 'lr': 1e-05, 'weight_decay': 0.0, 'clip_eps': 0.2,
        # the recipe `default` (spanrl/core/recipes.py): Dr. GRPO, zero-variance groups dropped,
        # self-imitation 3 x 4, k3 KL 0.2, 8 mini-batches, groups batching of 6 groups
        'loss_agg': 'token_mean', 'advantage_std_scale': False, 'drop_zero_variance': True,
        'negative_advantage_weight': 1.0, 'prefix_tree_advantage': False,
        'self_imitation_updates': 3, 'self_imitation_weight': 4.0, 'self_imitation_loss': 'clipped', 'prefix_merge': True, 'tree_packing': False, 'kl_coef': 0.2, 'mini_batches': 8, 'batching': 'groups', 'update_groups': 6,
        'grad_clip': 1.0, 'ppo_epochs': 1, 'min_batch': 16, 'max_batch': 64, 'idle_flush_s': 10.0,
        'ranks': 1, 'zero_stage': 0, 'micro_batch': 8, 'micro_batch_tokens': 2048, 'activation_checkpointing': True, 'lora_rank': 0,
        'lora_alpha': 32.0, 'lora_dropout': 0.0,
        'lora_target_modules': 'q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj', 'logprob_chunk': 256,
        'max_tokens': 4096, 'checkpoint_every': 1, 'keep_local': 2, 'keep_published': 0, 'init_from': None,
        'start': 'earliest', 'max_updates': None, 'log_path': None, 'http': True, 'seed': None,
        'max_staleness': 4, 'stale_policy': 'refuse', 'ratio_cap': 3.0, 'dead_letter_topic': 'dead-letter'}


def test_reloader_defaults():
    from spanrl.trainer import reloader

    assert reloader.ReloaderConfig is ReloaderConfig
    assert ReloaderConfig.from_environ({}).model_dump() == {
        'run': None, 'checkpoints_topic': 'checkpoints', 'start': 'latest', 'from_version': 1, 'pause_mode': 'wait',
        'vllm_url': None, 'proxy_url': None, 'reload_timeout_s': 600.0, 'max_announcements': None,
        'watch_interval_s': 1.0, 'http': True, 'keep_local': 2, 'gate': False,
        'gate_agent': 'examples.math_agent.agent:math_agent', 'gate_evaluation': 'spanrl.infra.evaluation:gate_rewards',
        'gate_task_set': 'arith_word', 'gate_seed': 1000,
        'gate_offset': 200, 'gate_tasks': 40, 'gate_tolerance': 0.0, 'gate_concurrency': 8}


STREAM_TODAY = {
    'app_id': 'spanrl-stream', 'bootstrap': '127.0.0.1:19092', 'web_host': '127.0.0.1', 'web_port': 16066,
    'spans_topic': 'spans', 'rewards_topic': 'rewards', 'rollouts_topic': 'rollouts',
    'transitions_topic': 'transitions', 'samples_topic': 'samples', 'dead_letter_topic': 'dead-letter',
    'call_accounts_topic': 'call-accounts', 'orphan_spans_topic': 'orphan-spans', 'join_traces': True,
    'orphan_timeout_s': 300.0, 'credit_rule': 'identical', 'air_rules': '', 'train_agents': None,
    'reward_timeout_s': 60.0, 'reward_window_s': 604800.0, 'group_timeout_s': 120.0, 'rollout_timeout_s': 900.0,
    'settle_s': 2.0, 'production_idle_s': 300.0, 'retain_s': 3600.0, 'retain_max': 10000, 'tick_s': 0.5,
    'commit_interval_s': 0.5, 'session_timeout_s': 60.0,
    'linger_s': 0.02, 'payload_bucket': 'spanrl-payloads', 'claim_retry_s': 30.0, 'replication_factor': 0,
    'extra': {}}


def test_stream_defaults_once(monkeypatch):
    from spanrl.stream_jobs.app import StreamConfig
    from spanrl.stream_jobs.assembly import AssemblyConfig
    from spanrl.stream_jobs.grouping import GroupingConfig
    from spanrl.stream_jobs.joining import JoinConfig

    for var in ("SPANRL_HOST", "SPANRL_KAFKA_PORT", "SPANRL_KAFKA_BOOTSTRAP_SERVERS", "SPANRL_FAUST_WEB_PORT",
                "SPANRL_PAYLOAD_BUCKET"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setattr(S, "get_settings", lambda: Settings.from_environ({}))
    monkeypatch.setattr("spanrl.stream_jobs.app.get_settings", lambda: Settings.from_environ({}))
    for cfg in (StreamConfig(), StreamConfig.from_env({})):
        assert {f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg)} == STREAM_TODAY
    a, g, j = AssemblyConfig(), GroupingConfig(), JoinConfig()
    assert (a.reward_timeout_s, a.rollout_timeout_s, a.settle_s, a.production_idle_s, a.reward_window_s) == (
        60.0, 900.0, 2.0, 300.0, 604800.0)
    assert (g.group_timeout_s, g.late_join_s, j.orphan_timeout_s, j.orphan_topic) == (
        120.0, 604800.0, 300.0, "orphan-spans")


def test_stream_settings_from_a_mapping_not_the_process(monkeypatch):
    from spanrl.stream_jobs.app import StreamConfig

    monkeypatch.setenv("SPANRL_REWARD_TIMEOUT_S", "5")
    assert StreamSettings.from_environ({}).reward_timeout_s == 60.0
    assert StreamSettings().reward_timeout_s == 5.0
    cfg = StreamConfig.from_env({"SPANRL_REWARD_TIMEOUT_S": "15", "SPANRL_TRAIN_AGENTS": "a,b",
                                 "spanrl_settle_s": "3", "SPANRL_STREAM_TICK_S": "0.25"})
    assert (cfg.reward_timeout_s, cfg.settle_s, cfg.tick_s, sorted(cfg.train_agents.names)) == (15.0, 3.0, 0.25,
                                                                                                ["a", "b"])


@pytest.mark.parametrize("text, on", [("true", True), ("", True), ("maybe", True), ("1", True), ("0", False),
                                      ("false", False), (" OFF ", False), ("No", False)])
def test_join_traces_reads_as_before(text, on):
    assert StreamSettings.from_environ({"SPANRL_STREAM_JOIN_TRACES": text}).stream_join_traces is on


def test_other_sections_defaults():
    from spanrl.producers import bridge
    from spanrl.schemas import topics

    assert TopicSettings.from_environ({}).model_dump() == {"rollout_partitions": 4, "topic_prefix": ""}
    assert ProducerSettings.from_environ({}).model_dump() == {"bridge_max_body_bytes": 8 << 20,
                                                              "proxy_max_body_bytes": 16 << 20, "policy_version": 0,
                                                              "capture_messages": True, "proxy_rollout_idle_s": 1800.0}
    assert DashboardSettings.from_environ({}).model_dump() == {"dashboard_eval_dirs": "results/eval:results"}
    assert StackSettings.from_environ({}).model_dump() == {"vllm_threads": "2", "trainer_threads": "2"}
    assert S.STACK_TRAINER_START == "latest"
    assert topics.ROLLOUT_PARTITIONS == TopicSettings().rollout_partitions
    assert bridge.DEFAULT_MAX_BODY == ProducerSettings().bridge_max_body_bytes


def test_topic_prefix_from_the_settings(monkeypatch):
    from spanrl.producers.kafka import Topics

    monkeypatch.setenv("SPANRL_TOPIC_PREFIX", "t1-")
    assert Topics.from_env().spans.name == "t1-spans"
    monkeypatch.delenv("SPANRL_TOPIC_PREFIX")
    assert Topics.from_env().spans.name == "spans"


# ---- the settings reference's table -----------------------------------------------------

def test_settings_reference_table_is_generated_from_the_declarations():
    page = (ROOT / S.SETTINGS_PAGE).read_text()
    assert S.page_table(page) == S.markdown_table(), (
        f"{S.SETTINGS_PAGE}'s settings table is stale: python -m spanrl.core.settings --write {S.SETTINGS_PAGE}")
    assert "| `SPANRL_REWARD_TIMEOUT_S` | float | `60.0` | s | stream | " in page


def test_markdown_table_lists_every_name_once():
    table = S.markdown_table()
    rows = re.findall(r"^\| `(SPANRL_[A-Z0-9_]+)` \|", table, re.M)
    assert sorted(rows) == sorted(S.known_names())
    assert str(Path.home()) not in table  # machine-independent


# ---- nothing else reads the environment --------------------------------------------------

ENV_ACCESS = re.compile(r"\bos\.environ\b|\bgetenv\b|\bputenv\b|\bunsetenv\b|__import__\(\s*['\"]os['\"]\s*\)"
                        r"|\bfrom os import\b.*\benviron\b")


def test_only_the_settings_module_touches_the_environment():
    offenders = []
    for folder in ("producers", "stream_jobs", "trainer", "infra", "schemas", "spanrl"):  # "**" follows no link
        for f in sorted((ROOT / folder).rglob("*.py")):
            if f == ROOT / "spanrl" / "core" / "settings.py":
                continue
            for n, line in enumerate(f.read_text().splitlines(), 1):
                if ENV_ACCESS.search(line):
                    offenders.append(f"{f.relative_to(ROOT)}:{n}: {line.strip()}")
    assert offenders == []


# ---- one DeepSpeed config ----------------------------------------------------------------

def test_one_deepspeed_config(capsys):
    from spanrl.trainer import train

    assert not (ROOT / "trainer" / "ds_config_gpu.json").exists()
    gpu = train.deepspeed_config(8, 1.0, 1e-5, 0.0, gpu=True, zero_stage=2)
    cpu = train.deepspeed_config(8, 1.0, 1e-5, 0.0, gpu=False, zero_stage=2)
    assert gpu["bf16"] == {"enabled": True} and gpu["optimizer"]["type"] == "AdamW"
    assert "bf16" not in cpu and "optimizer" not in cpu
    assert gpu["zero_optimization"] == cpu["zero_optimization"] == {
        "stage": 2, "contiguous_gradients": True, "overlap_comm": False, "reduce_bucket_size": train.BUCKET_ELEMENTS,
        "allgather_bucket_size": train.BUCKET_ELEMENTS}
    assert train.deepspeed_config(8, 1.0, 1e-5, 0.0, gpu=False, zero_stage=3)["zero_optimization"] == {
        "stage": 3, "contiguous_gradients": True, "overlap_comm": False, "reduce_bucket_size": train.BUCKET_ELEMENTS,
        "stage3_prefetch_bucket_size": train.BUCKET_ELEMENTS, "stage3_max_live_parameters": train.BUCKET_ELEMENTS}
    assert train.deepspeed_config(8, 1.0, 1e-5, 0.0, gpu=False)["zero_optimization"] == {  # one rank: no ZeRO
        "stage": 0, "contiguous_gradients": True, "overlap_comm": False, "reduce_bucket_size": train.BUCKET_ELEMENTS}
    with pytest.raises(ValueError, match="zero_stage"):
        train.deepspeed_config(8, 1.0, 1e-5, 0.0, zero_stage=1)
    train.main(["--deepspeed-config", "--gpu"])
    printed = json.loads(capsys.readouterr().out)
    cfg = TrainerConfig()
    assert printed == train.deepspeed_config(cfg.micro_batch, cfg.grad_clip, cfg.lr, cfg.weight_decay, gpu=True,
                                             zero_stage=cfg.zero_stage)
    with pytest.raises(ValueError, match="logprob_chunk=0"):  # ZeRO-3 keeps the output layer partitioned
        train.Trainer(TrainerConfig(zero_stage=3, http=False))
