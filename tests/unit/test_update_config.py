"""The update takes its settings whole (trainer/train.py ``UpdateConfig``): every option of
``train_update`` comes from TrainerConfig through ``UpdateConfig.of``, so the trainer and the
benchmarks that train as it does (bench/tree_pack.py) cannot map the settings differently."""
from __future__ import annotations

import dataclasses
import inspect

from spanrl.core.settings import TrainerConfig
from spanrl.trainer.train import UpdateConfig, train_update

#: train_update's parameters that are not settings: the data, the models, the run's temperature
NOT_SETTINGS = {"engine", "samples", "pad_token_id", "ref_model", "self_imitation", "temperature"}


def test_every_update_option_is_a_trainer_setting_passed_through_the_config():
    names = {f.name for f in dataclasses.fields(UpdateConfig)}
    assert set(inspect.signature(train_update).parameters) - NOT_SETTINGS == names
    assert names <= set(TrainerConfig.model_fields)


def test_of_reads_the_trainer_config_and_ratio_cap_only_when_stale_samples_are_kept():
    cfg = TrainerConfig.from_environ({"SPANRL_RECIPE": "default", "SPANRL_TRAINER_MINI_BATCHES": "3"})
    update = UpdateConfig.of(cfg)
    assert (update.mini_batches, update.kl_coef, update.advantage_std_scale, update.drop_zero_variance,
            update.ratio_cap) == (3, 0.2, False, True, None)
    assert UpdateConfig.of(cfg, stale_kept=True).ratio_cap == cfg.ratio_cap == 3.0
    packed = UpdateConfig.of(cfg, tree_packing=True)
    assert packed.tree_packing and dataclasses.replace(packed, tree_packing=False) == update
