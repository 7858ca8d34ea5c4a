"""The Trainer's flags are checked once, strictly, into a frozen TrainerConfig."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest

import ember
from ember.config import FlagError, TrainerConfig


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        ({"enable_progress_bar": "no"}, r"enable_progress_bar='no': expected True or False"),
        ({"enable_checkpointing": 0}, r"enable_checkpointing=0: expected True or False"),
        ({"inference_mode": None}, r"inference_mode=None: expected True or False"),
        ({"sync_batchnorm": 1}, r"sync_batchnorm=1: expected True or False"),
        ({"benchmark": "yes"}, r"benchmark='yes': expected True or False or None"),
        ({"max_epochs": True}, r"max_epochs=True: `max_epochs` must be a non-negative integer or -1"),
        ({"max_steps": 2.0}, r"max_steps=2.0"),
        ({"num_nodes": True}, r"num_nodes=True: `num_nodes` should be an int >= 1"),
        ({"log_every_n_steps": True}, r"log_every_n_steps=True: `log_every_n_steps` should be an int >= 0"),
        ({"accumulate_grad_batches": True}, r"=True: `accumulate_grad_batches` should be an int >= 1 or 'auto'"),
        ({"check_val_every_n_epoch": 0}, r"=0: `check_val_every_n_epoch` should be an integer >= 1 or None"),
        ({"limit_train_batches": True}, r"limit_train_batches=True: expected None, a number of batches"),
        ({"limit_val_batches": 1.01}, r"limit_val_batches=1.01: passed invalid value; an int counts batches \(>= 0\)"),
        ({"limit_train_batches": 1.5}, r"limit_train_batches=1.5: passed invalid value; .* or a whole number"),
        ({"limit_test_batches": -2.0}, r"limit_test_batches=-2.0: passed invalid value"),
        ({"fast_dev_run": -1}, r"fast_dev_run=-1: should be >= 0 \(a number of batches\), or True or False"),
        ({"fast_dev_run": 1.0}, r"fast_dev_run=1.0: should be >= 0"),
        ({"val_check_interval": 1.5}, r"val_check_interval=1.5: passed invalid value; expected a fraction"),
        ({"val_check_interval": True}, r"val_check_interval=True"),
        (
            {"val_check_interval": 0.5, "check_val_every_n_epoch": None},
            r"val_check_interval=0.5 with check_val_every_n_epoch=None: `val_check_interval` should be an integer",
        ),
        ({"gradient_clip_val": True}, r"gradient_clip_val=True: `gradient_clip_val` should be an int or a float >= 0"),
        ({"doctor": 5}, r"doctor=5: True \(watch 30 steps\), False, or a number of steps above 5"),
        ({"callbacks": ["not a callback"]}, r"callbacks=\['not a callback'\]: expected a Callback"),
        ({"logger": "csv"}, r"logger='csv': expected True, False, a Logger"),
        ({"default_root_dir": 3}, r"default_root_dir=3: expected a path"),
        ({"devices": 1.5}, r"devices=1.5: use 'auto', a count"),
        ({"strategy": 3}, r"strategy=3: expected a strategy name or an ember Strategy"),
    ],
)
def test_each_flag_takes_only_its_type_and_range(flags: dict[str, Any], message: str) -> None:
    with pytest.raises(FlagError, match=message):
        ember.Trainer(**flags)


def test_validation_counted_across_epochs_takes_batches_or_a_duration() -> None:
    for interval in (1.0, 3, "00:00:01:00"):  # 1.0 (the default) validates at each epoch's end
        ember.Trainer(accelerator="cpu", val_check_interval=interval, check_val_every_n_epoch=None)


def test_a_flag_error_is_both_a_value_error_and_a_type_error() -> None:
    for error in (ValueError, TypeError):
        with pytest.raises(error, match="enable_progress_bar='no'"):
            ember.Trainer(enable_progress_bar="no")


def test_the_config_is_frozen_keyword_only_and_derives_its_defaults() -> None:
    config = ember.Trainer(accelerator="cpu", max_steps=10, compile=True).config
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.max_steps = 3  # type: ignore[misc]
    with pytest.raises(TypeError):
        TrainerConfig("cpu")  # type: ignore[misc]
    assert config.epoch_limit == -1 and config.compile_options == {}
    assert TrainerConfig().epoch_limit == 1000 and TrainerConfig(max_time={"minutes": 2}).max_time_seconds == 120


def test_every_field_is_documented() -> None:
    import ast
    import inspect
    import itertools

    from ember import config

    tree = ast.parse(inspect.getsource(config))
    body = next(node for node in tree.body if isinstance(node, ast.ClassDef) and node.name == "TrainerConfig").body
    documented = {
        field.target.id
        for field, following in itertools.pairwise(body)
        if isinstance(field, ast.AnnAssign)
        and isinstance(field.target, ast.Name)
        and isinstance(following, ast.Expr)
        and isinstance(following.value, ast.Constant)
    }
    assert {field.name for field in dataclasses.fields(TrainerConfig)} == documented


def test_trainer_arguments_and_config_fields_are_the_same() -> None:
    import inspect

    arguments = set(inspect.signature(ember.Trainer).parameters)
    assert arguments == {field.name for field in dataclasses.fields(TrainerConfig)}


def test_a_whole_float_above_one_is_a_number_of_batches() -> None:
    config = ember.Trainer(limit_train_batches=3.0, limit_test_batches=1e50, val_check_interval=2.0).config
    assert config.limit_train_batches == 3 and isinstance(config.limit_train_batches, int)
    assert config.limit_test_batches == int(1e50) and config.val_check_interval == 2
    assert isinstance(config.val_check_interval, int)
    assert ember.Trainer(limit_val_batches=1.0).config.limit_val_batches == 1.0  # a fraction: all of them


def test_the_trainer_gives_its_flags_in_lightnings_convention() -> None:
    trainer = ember.Trainer(num_sanity_val_steps=-1, limit_val_batches=0.5, limit_test_batches=4)
    limits = (trainer.limit_train_batches, trainer.limit_val_batches, trainer.limit_test_batches,
              trainer.limit_predict_batches)  # fmt: skip
    assert limits == (1.0, 0.5, 4, 1.0) and trainer.num_sanity_val_steps == float("inf")
    assert trainer.fast_dev_run is False and trainer.val_check_interval == 1.0
    assert trainer.config.limit_train_batches is None and trainer.config.num_sanity_val_steps == -1  # what loops read
    for runs, shown in ((True, True), (1, True), (3, 3)):
        trainer = ember.Trainer(fast_dev_run=runs, limit_val_batches=0.5, num_sanity_val_steps=5, max_epochs=4)
        assert trainer.fast_dev_run is shown
        assert trainer.limit_train_batches == trainer.limit_val_batches == trainer.limit_predict_batches == int(runs)
        assert trainer.num_sanity_val_steps == 0 and trainer.max_epochs == 1


def test_deterministic_with_benchmark_is_warned_and_both_are_set(monkeypatch: pytest.MonkeyPatch) -> None:
    import torch

    monkeypatch.setattr(torch.backends.cudnn, "benchmark", False)
    monkeypatch.setattr(torch.backends.cudnn, "deterministic", False)
    monkeypatch.setattr(torch, "use_deterministic_algorithms", lambda *args, **kwargs: None)  # left as it was
    with pytest.warns(UserWarning, match=r"`deterministic=True` and `benchmark=True`. Note that PyTorch ignores"):
        trainer = ember.Trainer(deterministic=True, benchmark=True, logger=False, enable_checkpointing=False)
    assert trainer.config.benchmark is True
    assert torch.backends.cudnn.benchmark and torch.backends.cudnn.deterministic


def test_deterministic_false_turns_torch_determinism_off_and_none_leaves_it(monkeypatch: pytest.MonkeyPatch) -> None:
    import torch

    calls: list[tuple[bool, bool]] = []

    def record(on: bool, warn_only: bool = False) -> None:
        calls.append((on, warn_only))

    monkeypatch.setattr(torch, "use_deterministic_algorithms", record)
    monkeypatch.setattr(torch.backends.cudnn, "deterministic", False)
    for flag in (None, False, True, "warn"):
        ember.Trainer(deterministic=flag, logger=False, enable_checkpointing=False)
    assert calls == [(False, False), (True, False), (True, True)]  # None: the program's own setting stays


def test_default_root_dir_is_read_with_the_home_directory_expanded(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    import os

    monkeypatch.setenv("HOME", str(tmp_path))
    trainer = ember.Trainer(default_root_dir="~/runs/../here", enable_checkpointing=False, logger=False)
    assert trainer.default_root_dir == os.path.join(str(tmp_path), "here")
    assert ember.Trainer(default_root_dir="s3://bucket/runs", logger=False).default_root_dir == "s3://bucket/runs"


def test_clipping_algorithm_and_profiler_names_are_taken_in_any_case() -> None:
    from ember.profilers import SimpleProfiler

    trainer = ember.Trainer(gradient_clip_val=0.5, gradient_clip_algorithm="VALUE", profiler="Simple", logger=False)
    assert trainer.gradient_clip_algorithm == "value" and isinstance(trainer.profiler, SimpleProfiler)
    with pytest.raises(FlagError, match="`gradient_clip_algorithm` foo is invalid"):
        ember.Trainer(gradient_clip_algorithm="Foo")


def test_a_refused_precision_or_checkpoint_callback_is_named_in_lightnings_words() -> None:
    with pytest.raises(ValueError, match=r"Precision 'fp16' is invalid. Allowed precision values: .*'bf16-true'"):
        ember.Trainer(precision="fp16")
    with pytest.raises(ValueError, match="Trainer was configured with `enable_checkpointing=False` but found"):
        ember.Trainer(enable_checkpointing=False, callbacks=[ember.callbacks.ModelCheckpoint()], logger=False)


@pytest.mark.parametrize("devices", [[0], [0, 1], -1, "-1", "0,", 1.5])
def test_devices_on_the_cpu_accelerator_is_a_count_of_processes(devices: Any) -> None:
    with pytest.raises(TypeError, match=r"`devices` selected with `CPUAccelerator` should be an int > 0"):
        ember.Trainer(accelerator="cpu", devices=devices)
    assert ember.Trainer(accelerator="cpu", devices="1", logger=False).num_devices == 1
