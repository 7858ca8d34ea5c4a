"""The training loop: steps, accumulation, schedulers, stopping, validation scheduling, hooks."""

from __future__ import annotations

import functools
import math
import signal
import time
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from conftest import Regressor, make_data, make_loader, parameters_of, quiet_trainer
from torch.utils.data import DataLoader, IterableDataset

import ember
from ember.callbacks import Callback
from ember.exceptions import MisconfigurationException
from ember.loops.stopping import Interruptions
from ember.strategies.single import SingleDeviceStrategy


def test_fit_trains_and_counts_optimizer_steps() -> None:
    model = Regressor()
    trainer = quiet_trainer(max_epochs=3)
    before = trainer.validate(model, make_loader(), verbose=False)[0]["val_loss"]
    trainer.fit(model, make_loader(), make_loader())
    assert trainer.global_step == 3 * 8 and trainer.current_epoch == 3
    assert trainer.callback_metrics["val_loss"] < before / 2


@pytest.mark.parametrize("accumulate", [2, 4])
def test_accumulated_micro_batches_equal_one_large_batch(accumulate: int) -> None:
    small = Regressor()
    quiet_trainer(max_epochs=2, accumulate_grad_batches=accumulate, logger=False).fit(
        small, make_loader(64, batch_size=4)
    )
    large = Regressor()
    quiet_trainer(max_epochs=2, logger=False).fit(large, make_loader(64, batch_size=4 * accumulate))
    for a, b in zip(parameters_of(small), parameters_of(large), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


class _Batches(torch.utils.data.Sampler[list[int]]):
    """Yields index batches of the given sizes, in order."""

    def __init__(self, sizes: list[int]) -> None:
        self.sizes = sizes

    def __iter__(self) -> Any:
        start = 0
        for size in self.sizes:
            yield list(range(start, start + size))
            start += size

    def __len__(self) -> int:
        return len(self.sizes)


class _Unsized(IterableDataset):
    def __init__(self, n: int) -> None:
        self.data = make_data(n)

    def __iter__(self) -> Any:
        return iter(self.data)


def test_short_last_window_still_steps_and_averages_over_its_own_size() -> None:
    # 5 batches of 4 with accumulation 2: windows of 2, 2 and 1 micro-batches.
    accumulated = Regressor()
    trainer = quiet_trainer(max_epochs=1, accumulate_grad_batches=2, logger=False)
    trainer.fit(accumulated, make_loader(20, batch_size=4))
    assert trainer.global_step == 3
    reference = Regressor()
    quiet_trainer(max_epochs=1, logger=False).fit(
        reference, DataLoader(make_data(20), batch_sampler=_Batches([8, 8, 4]))
    )
    for a, b in zip(parameters_of(accumulated), parameters_of(reference), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_short_last_window_of_a_loader_without_length() -> None:
    accumulated = Regressor()
    trainer = quiet_trainer(max_epochs=1, accumulate_grad_batches=3, logger=False)
    trainer.fit(accumulated, DataLoader(_Unsized(20), batch_size=4))  # windows of 3 and 2 batches
    assert trainer.global_step == 2
    reference = Regressor()
    quiet_trainer(max_epochs=1, logger=False).fit(reference, DataLoader(make_data(20), batch_sampler=_Batches([12, 8])))
    for a, b in zip(parameters_of(accumulated), parameters_of(reference), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


class _Scheduled(Regressor):
    def __init__(self, interval: str, frequency: int = 1) -> None:
        super().__init__()
        self.interval, self.frequency = interval, frequency

    def configure_optimizers(self) -> Any:
        optimizer = torch.optim.SGD(self.parameters(), lr=1.0)
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
        return {
            "optimizer": optimizer,
            "lr_scheduler": {"scheduler": scheduler, "interval": self.interval, "frequency": self.frequency},
        }


def test_step_scheduler_steps_once_per_optimizer_step() -> None:
    model = _Scheduled("step")
    trainer = quiet_trainer(max_epochs=1, accumulate_grad_batches=2, logger=False)
    trainer.fit(model, make_loader(64, batch_size=8))  # 8 batches -> 4 optimizer steps
    assert trainer.optimizers[0].param_groups[0]["lr"] == pytest.approx(0.5**4)


def test_epoch_scheduler_respects_frequency() -> None:
    model = _Scheduled("epoch", frequency=2)
    trainer = quiet_trainer(max_epochs=4, logger=False)
    trainer.fit(model, make_loader(16, batch_size=8))
    assert trainer.optimizers[0].param_groups[0]["lr"] == pytest.approx(0.5**2)


class _Plateau(Regressor):
    def configure_optimizers(self) -> Any:
        optimizer = torch.optim.SGD(self.parameters(), lr=1e-3)
        # No change of val_loss counts as an improvement: every epoch after the first lowers the LR.
        scheduler = torch.optim.lr_scheduler.ReduceLROnPlateau(
            optimizer, patience=0, factor=0.1, threshold=1e6, threshold_mode="abs"
        )
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "monitor": "val_loss"}}


class _Configured(Regressor):
    def __init__(self, make: Any) -> None:
        super().__init__()
        self.make = make

    def configure_optimizers(self) -> Any:
        optimizer = torch.optim.SGD(self.parameters(), lr=1.0)
        return self.make(optimizer, torch.optim.lr_scheduler.StepLR(optimizer, 1, gamma=0.5))


def test_configure_optimizers_takes_lightnings_lenient_forms() -> None:
    def fit(make: Any, **flags: Any) -> ember.Trainer:
        trainer = quiet_trainer(logger=False, **flags)
        trainer.fit(_Configured(make), make_loader())
        return trainer

    # ([optimizers], scheduler): a single scheduler, not in a list.
    trainer = fit(lambda optimizer, scheduler: ([optimizer], scheduler), max_epochs=2)
    assert trainer.optimizers[0].param_groups[0]["lr"] == 0.25
    # Keys Lightning does not know are warned about and ignored; "reduce_on_plateau" is one it knows.
    with pytest.warns(RuntimeWarning, match=r"unsupported keys in the lr scheduler dict: \{'intervl'\}"):
        trainer = fit(lambda o, s: {"optimizer": o, "lr_scheduler": {"scheduler": s, "intervl": "step"}}, max_epochs=2)
    assert trainer.optimizers[0].param_groups[0]["lr"] == 0.25 and trainer.lr_scheduler_configs[0].interval == "epoch"
    with pytest.warns(RuntimeWarning, match=r"unsupported keys in the optimizer configuration: \{'frequency'\}"):
        fit(lambda optimizer, scheduler: {"optimizer": optimizer, "frequency": 2}, max_steps=1)
    trainer = fit(
        lambda o, s: {"optimizer": o, "lr_scheduler": {"scheduler": s, "reduce_on_plateau": False}}, max_steps=1
    )
    assert trainer.lr_scheduler_configs[0].reduce_on_plateau is False


def test_reduce_on_plateau_reads_the_monitored_metric() -> None:
    trainer = quiet_trainer(max_epochs=3, logger=False)
    trainer.fit(_Plateau(), make_loader(), make_loader())
    assert trainer.optimizers[0].param_groups[0]["lr"] == pytest.approx(1e-5)


class _PlateauPerSteps(_Plateau):
    """A plateau scheduler stepped every 4 optimizer steps on the validation run every 4 batches."""

    def __init__(self) -> None:
        super().__init__()
        self.stepped: list[tuple[int, float]] = []
        self.validated: list[float] = []

    def configure_optimizers(self) -> Any:
        config = super().configure_optimizers()
        config["lr_scheduler"].update(interval="step", frequency=4)
        return config

    def lr_scheduler_step(self, scheduler: Any, metric: Any) -> None:
        self.stepped.append((self.global_step, float(metric)))
        scheduler.step(metric)

    def on_validation_end(self) -> None:
        self.validated.append(float(self.trainer.callback_metrics["val_loss"]))


def test_a_plateau_scheduler_of_steps_steps_after_that_steps_validation_and_reads_its_metric() -> None:
    model = _PlateauPerSteps()
    quiet_trainer(max_epochs=1, val_check_interval=4, logger=False).fit(model, make_loader(), make_loader())
    assert model.stepped == [(4, model.validated[0]), (8, model.validated[1])]


def test_a_plateau_scheduler_whose_metric_is_missing_raises_or_with_strict_false_warns_and_waits() -> None:
    def plateau(strict: bool) -> Any:
        def make(optimizer: torch.optim.Optimizer, scheduler: Any) -> Any:
            plateau = torch.optim.lr_scheduler.ReduceLROnPlateau(optimizer, patience=0)
            return {"optimizer": optimizer, "lr_scheduler": {"scheduler": plateau, "monitor": "nope", "strict": strict}}

        return _Configured(make)

    with pytest.raises(MisconfigurationException, match=r"metric nope which is not available\. Available metrics"):
        quiet_trainer(max_epochs=1, logger=False).fit(plateau(True), make_loader())
    trainer = quiet_trainer(max_epochs=2, logger=False)
    with pytest.warns(RuntimeWarning, match="metric nope which is not available but strict is set to `False`"):
        trainer.fit(plateau(False), make_loader())
    assert trainer.optimizers[0].param_groups[0]["lr"] == 1.0


def test_max_steps_limit_batches_and_max_time() -> None:
    trainer = quiet_trainer(max_steps=5, logger=False)
    trainer.fit(Regressor(), make_loader(64, batch_size=4))
    assert trainer.global_step == 5

    trainer = quiet_trainer(max_epochs=2, limit_train_batches=3, logger=False)
    trainer.fit(Regressor(), make_loader(64, batch_size=4))
    assert trainer.global_step == 6

    trainer = quiet_trainer(max_epochs=1, limit_train_batches=0.5, logger=False)
    trainer.fit(Regressor(), make_loader(64, batch_size=4))
    assert trainer.global_step == 8

    trainer = quiet_trainer(max_time={"seconds": 1}, logger=False)
    slow = Regressor()
    slow.on_train_batch_end = lambda *args: __import__("time").sleep(0.05)  # type: ignore[method-assign]
    trainer.fit(slow, make_loader(64, batch_size=4))
    assert 5 < trainer.global_step < 40


class _ValidationCounter(Callback):
    def __init__(self) -> None:
        self.at: list[tuple[int, int]] = []

    def on_validation_end(self, trainer: ember.Trainer, module: ember.Module) -> None:
        if not trainer.sanity_checking:
            trainer_position = (trainer.fit_loop.progress.epoch, trainer.fit_loop.progress.epoch_batches)
            self.at.append(trainer_position)


@pytest.mark.parametrize(
    ("flags", "expected"),
    [
        ({}, [(0, 8), (1, 8)]),
        ({"val_check_interval": 0.5}, [(0, 4), (0, 8), (1, 4), (1, 8)]),
        ({"val_check_interval": 3}, [(0, 3), (0, 6), (1, 3), (1, 6)]),
        ({"val_check_interval": 5, "check_val_every_n_epoch": None}, [(0, 5), (1, 2), (1, 7)]),
        ({"check_val_every_n_epoch": 2}, [(1, 8)]),
    ],
)
def test_validation_scheduling(flags: dict[str, Any], expected: list[tuple[int, int]]) -> None:
    counter = _ValidationCounter()
    trainer = quiet_trainer(max_epochs=2, callbacks=[counter], logger=False, **flags)
    trainer.fit(Regressor(), make_loader(64), make_loader(16))
    assert counter.at == expected


def test_sanity_check_runs_validation_before_training_without_recording_it() -> None:
    calls: list[int] = []

    class Counting(Regressor):
        def validation_step(self, batch: Any, batch_idx: int) -> None:
            calls.append(self.global_step)
            super().validation_step(batch, batch_idx)

    trainer = quiet_trainer(max_epochs=1, num_sanity_val_steps=2, logger=False)
    trainer.fit(Counting(), make_loader(32), make_loader(32))
    assert calls[:2] == [0, 0] and len(calls) == 2 + 4


def test_the_sanity_check_counts_its_own_batches_apart_from_validations() -> None:
    seen: list[tuple[bool, list[float], list[float]]] = []

    class Counting(Callback):
        def on_validation_start(self, trainer: ember.Trainer, module: ember.Module) -> None:
            seen.append((trainer.sanity_checking, trainer.num_val_batches, trainer.num_sanity_val_batches))

    trainer = quiet_trainer(max_epochs=1, num_sanity_val_steps=2, callbacks=[Counting()], logger=False)
    trainer.fit(Regressor(), make_loader(32), make_loader(32))
    assert seen == [(True, [4], [2]), (False, [4], [2])]
    assert (trainer.num_val_batches, trainer.num_sanity_val_batches) == ([4], [2])


@pytest.mark.parametrize(("every", "seen"), [(1, [[2]]), (2, [[]])])
def test_without_a_sanity_check_the_validation_loaders_are_asked_for_before_training_starts(
    every: int, seen: list[list[float]]
) -> None:
    class Counting(Regressor):
        def on_train_start(self) -> None:
            counts.append(list(self.trainer.num_val_batches))

    counts: list[list[float]] = []
    trainer = quiet_trainer(max_epochs=1, check_val_every_n_epoch=every, logger=False)  # no sanity check
    trainer.fit(Counting(), make_loader(), make_loader(16))
    assert counts == seen  # (the progress bar counts them from there); not before an epoch that does not validate


@pytest.mark.parametrize(
    ("returns", "accumulate", "seen"),
    [("loss", 1, ["loss"]), ("dict", 1, ["loss", "size"]), ("none", 1, []), ("loss", 2, ["loss"])],
)
def test_the_batch_end_hooks_get_a_dict_with_the_loss_detached(returns: str, accumulate: int, seen: list) -> None:
    class Returning(Regressor):
        def training_step(self, batch: Any, batch_idx: int) -> Any:
            loss = super().training_step(batch, batch_idx)
            self.losses.append(loss.detach())
            return {"none": None, "loss": loss, "dict": {"loss": loss, "size": len(batch[0])}}[returns]

        def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
            self.outputs.append(outputs)

    model = Returning()
    model.losses, model.outputs = [], []
    quiet_trainer(max_epochs=1, limit_train_batches=4, accumulate_grad_batches=accumulate, logger=False).fit(
        model, make_loader()
    )
    assert all(list(outputs) == seen for outputs in model.outputs)
    if seen:  # as the gradients, divided by accumulate_grad_batches (as Lightning's)
        losses = [outputs["loss"] for outputs in model.outputs]
        assert all(loss.grad_fn is None for loss in losses)
        assert torch.allclose(torch.stack(losses), torch.stack(model.losses) / accumulate)


class _StopsAt(Regressor):
    """Asks the Trainer to stop at training batch ``stop_at`` of the first epoch; records what the hooks see."""

    def __init__(self, stop_at: int) -> None:
        super().__init__()
        self.stop_at = stop_at
        self.seen: list[tuple[str, int, int]] = []

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        if batch_idx == self.stop_at and self.current_epoch == 0:
            self.trainer.should_stop = True
        return super().training_step(batch, batch_idx)

    def on_validation_start(self) -> None:
        self.seen.append(("validation", self.current_epoch, self.global_step))

    def on_train_end(self) -> None:
        self.seen.append(("train end", self.current_epoch, self.global_step))


@pytest.mark.parametrize(
    ("flags", "seen"),
    [
        ({}, [("validation", 0, 3), ("train end", 1, 3)]),  # validates before it stops
        ({"val_check_interval": 3}, [("validation", 0, 3), ("train end", 1, 3)]),  # once, where it was due anyway
        ({"check_val_every_n_epoch": 2}, [("train end", 1, 3)]),  # an epoch that does not validate
        ({"min_epochs": 2}, [("validation", 0, 8), ("validation", 1, 16), ("train end", 2, 16)]),  # at the minimum
    ],
)
def test_a_stop_inside_an_epoch_validates_and_counts_the_epoch_done(flags: dict[str, Any], seen: list) -> None:
    model = _StopsAt(2)
    trainer = quiet_trainer(max_epochs=3, logger=False, **flags)
    trainer.fit(model, make_loader(64), make_loader(16))
    assert model.seen == seen
    assert trainer.current_epoch == seen[-1][1]


def test_the_deadline_is_seen_at_the_last_batch_of_an_epoch_too() -> None:
    """Epochs of one batch (a full-batch fit) stop at ``max_time`` too, as a signal stops them: each step is checked."""

    class Slow(Regressor):
        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            time.sleep(0.2)  # the deadline passes during the first step
            return super().training_step(batch, batch_idx)

    trainer = quiet_trainer(max_epochs=5, max_time={"milliseconds": 100}, limit_train_batches=1, logger=False)
    trainer.fit(Slow(), make_loader(16))
    assert (trainer.global_step, trainer.current_epoch) == (1, 1)


@pytest.mark.parametrize(("min_epochs", "steps", "epochs"), [(None, 2, 2), (3, 6, 3)])
def test_a_stop_asked_as_an_epoch_starts_trains_none_of_its_batches_yet_ends_it(
    min_epochs: int | None, steps: int, epochs: int
) -> None:
    """As Lightning: ``should_stop`` set in ``on_train_epoch_start`` (when it may stop) ends that epoch at once."""

    class StopsAsEpochOneStarts(Regressor):
        def on_train_epoch_start(self) -> None:
            self.trainer.should_stop = self.current_epoch >= 1

    trainer = quiet_trainer(max_epochs=5, min_epochs=min_epochs, limit_train_batches=2, logger=False)
    trainer.fit(StopsAsEpochOneStarts(), make_loader(16))
    assert (trainer.global_step, trainer.current_epoch) == (steps, epochs)


def test_max_steps_inside_an_epoch_counts_it_done_and_a_checkpoint_still_resumes_inside_it(tmp_path: Any) -> None:
    model = _StopsAt(-1)
    trainer = quiet_trainer(max_steps=5, logger=False)
    trainer.fit(model, make_loader(64), make_loader(16))
    assert model.seen == [("train end", 1, 5)] and trainer.current_epoch == 1
    trainer.fit(model, make_loader(64))  # nothing left to train: it stays so
    assert (trainer.global_step, trainer.current_epoch) == (5, 1)
    trainer.save_checkpoint(tmp_path / "mid.ckpt")
    resumed = quiet_trainer(max_steps=8, logger=False)
    resumed.fit(Regressor(), make_loader(64), ckpt_path=tmp_path / "mid.ckpt")
    assert (resumed.global_step, resumed.current_epoch) == (8, 1)  # the epoch's last three batches, then its end


def test_gradient_clipping_by_value_and_norm() -> None:
    for algorithm, bound in (("value", 0.01), ("norm", 0.01)):
        model = Regressor(lr=1.0)
        before = parameters_of(model)
        quiet_trainer(max_steps=1, gradient_clip_val=bound, gradient_clip_algorithm=algorithm, logger=False).fit(
            model, make_loader(8, batch_size=8)
        )
        changes = torch.cat([(a - b).flatten() for a, b in zip(parameters_of(model), before, strict=True)])
        if algorithm == "value":
            assert changes.abs().max() <= bound + 1e-7
        else:
            assert changes.norm() <= bound + 1e-6


class _Manual(Regressor):
    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False
        self.other = torch.nn.Linear(4, 1)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        first, second = self.optimizers()
        x, y = batch
        for optimizer, layer in ((first, self.layer), (second, self.other)):
            optimizer.zero_grad()
            loss = F.mse_loss(layer(x), y)
            self.manual_backward(loss)
            optimizer.step()
        self.lr_schedulers().step()
        return loss

    def configure_optimizers(self) -> Any:
        first = torch.optim.SGD(self.layer.parameters(), lr=0.05)
        second = torch.optim.SGD(self.other.parameters(), lr=0.05)
        return [first, second], [torch.optim.lr_scheduler.StepLR(first, step_size=1, gamma=0.9)]


def test_manual_optimization_with_two_optimizers() -> None:
    model = _Manual()
    before = parameters_of(model)
    trainer = quiet_trainer(max_epochs=1, logger=False)
    trainer.fit(model, make_loader(32, batch_size=8))
    assert trainer.global_step == 2 * 4  # each optimizer step counts, as in Lightning
    assert trainer.optimizers[0].param_groups[0]["lr"] == pytest.approx(0.05 * 0.9**4)
    assert all(not torch.equal(a, b) for a, b in zip(parameters_of(model), before, strict=True))


def test_a_manual_step_with_a_closure_returns_its_loss_and_the_raw_optimizers_are_at_hand() -> None:
    class Closing(Regressor):
        automatic_optimization = False

        def training_step(self, batch: Any, batch_idx: int) -> Any:
            optimizer = self.optimizers()
            assert self.optimizers(use_pl_optimizer=False) is self.trainer.optimizers[0] is optimizer.optimizer

            def closure() -> torch.Tensor:
                optimizer.zero_grad()
                loss = super(Closing, self).training_step(batch, batch_idx)
                self.manual_backward(loss)
                return loss

            self.returned.append(optimizer.step(closure=closure))
            return self.returned[-1]

    model = Closing()
    model.returned = []
    quiet_trainer(max_steps=3, logger=False).fit(model, make_loader())
    assert len(model.returned) == 3 and all(isinstance(loss, torch.Tensor) for loss in model.returned)


def test_returning_none_skips_the_batch_and_minus_one_ends_the_epoch() -> None:
    class Skipping(Regressor):
        def training_step(self, batch: Any, batch_idx: int) -> Any:
            return None if batch_idx % 2 else super().training_step(batch, batch_idx)

        def on_train_batch_start(self, batch: Any, batch_idx: int) -> int | None:
            return -1 if batch_idx == 6 else None

    trainer = quiet_trainer(max_epochs=1, logger=False)
    trainer.fit(Skipping(), make_loader(64, batch_size=8))
    assert trainer.global_step == 3  # batches 0, 2 and 4 stepped; 6 ended the epoch


def test_hooks_run_in_order() -> None:
    calls: list[str] = []
    names = [
        "on_fit_start", "on_train_start", "on_train_epoch_start", "on_train_batch_start", "on_before_optimizer_step",
        "on_train_batch_end", "on_validation_epoch_start", "on_validation_epoch_end", "on_train_epoch_end",
        "on_train_end", "on_fit_end",
    ]  # fmt: skip

    class Recording(Regressor):
        pass

    for name in names:
        setattr(Recording, name, lambda self, *args, _name=name: calls.append(_name))

    trainer = quiet_trainer(max_epochs=1, limit_train_batches=1, logger=False)
    trainer.fit(Recording(), make_loader(), make_loader())
    assert calls == names


def test_validate_test_predict_return_values() -> None:
    model = Regressor()
    trainer = quiet_trainer(logger=False)
    results = trainer.validate(model, [make_loader(16), make_loader(32)], verbose=False)
    assert len(results) == 2
    assert set(results[0]) == {"val_loss/dataloader_idx_0"} and set(results[1]) == {"val_loss/dataloader_idx_1"}
    assert trainer.test(model, make_loader(), verbose=False)[0]["test_loss"] > 0
    predictions = trainer.predict(model, DataLoader(torch.randn(10, 4), batch_size=4))
    assert [tuple(p.shape) for p in predictions] == [(4, 1), (4, 1), (2, 1)]
    several = trainer.predict(model, [DataLoader(torch.randn(4, 4)), DataLoader(torch.randn(2, 4))])
    assert [len(outputs) for outputs in several] == [4, 2]


def test_datamodule_supplies_data_and_gets_its_hooks_called() -> None:
    stages: list[str] = []

    class Data(ember.DataModule):
        def prepare_data(self) -> None:
            stages.append("prepare")

        def setup(self, stage: str) -> None:
            stages.append(stage)

        def train_dataloader(self) -> DataLoader:
            return make_loader(16)

        def val_dataloader(self) -> DataLoader:
            return make_loader(16)

        def test_dataloader(self) -> DataLoader:
            return make_loader(16)

    trainer = quiet_trainer(max_epochs=1, logger=False)
    data = Data()
    trainer.fit(Regressor(), datamodule=data)
    trainer.test(Regressor(), datamodule=data, verbose=False)
    assert stages == ["prepare", "fit", "prepare", "test"]
    assert trainer.global_step == 2


def test_a_datamodule_given_is_the_only_source_of_loaders() -> None:
    class TrainOnly(ember.DataModule):
        def train_dataloader(self) -> DataLoader:
            return make_loader(8)

    class WithOwnLoaders(Regressor):
        def val_dataloader(self) -> DataLoader:
            raise AssertionError("a datamodule was given: the module's loaders are not asked for")

        test_dataloader = val_dataloader

    trainer = quiet_trainer(max_epochs=1, logger=False, enable_checkpointing=False)
    with pytest.warns(UserWarning, match="have no `val_dataloader`. Skipping val loop"):
        trainer.fit(WithOwnLoaders(), datamodule=TrainOnly())
    with pytest.raises(MisconfigurationException, match="`test_dataloader` must be implemented.*DataModule given"):
        trainer.test(WithOwnLoaders(), datamodule=TrainOnly())


def test_module_dataloader_hooks_are_used() -> None:
    class WithData(Regressor):
        def train_dataloader(self) -> DataLoader:
            return make_loader(24)

    trainer = quiet_trainer(max_epochs=1, logger=False)
    trainer.fit(WithData())
    assert trainer.global_step == 3


def test_model_is_placed_once_and_estimated_steps_are_known_early() -> None:
    seen: list[float] = []

    class Planning(Regressor):
        def configure_optimizers(self) -> torch.optim.Optimizer:
            seen.append(self.trainer.estimated_stepping_batches)
            return super().configure_optimizers()

    trainer = quiet_trainer(max_epochs=3, accumulate_grad_batches=2, logger=False)
    trainer.fit(Planning(), make_loader(40, batch_size=8))  # 5 batches -> 3 steps per epoch
    assert seen == [9] and trainer.global_step == 9
    assert math.isinf(quiet_trainer(max_time="00:00:01:00").estimated_stepping_batches)


def test_estimated_steps_in_setup_ask_for_the_training_loader_once_and_validation_follows_its_length(
    caplog: pytest.LogCaptureFixture,
) -> None:
    seen: list[float] = []
    asked: list[str] = []

    class Planning(Regressor):
        def setup(self, stage: str) -> None:
            seen.append(self.trainer.estimated_stepping_batches)

        def train_dataloader(self) -> DataLoader:
            asked.append("train")
            return make_loader(40, batch_size=8)

        def validation_step(self, batch: Any, batch_idx: int) -> None:
            asked.append(f"validation after {self.trainer.global_step}")

        def val_dataloader(self) -> DataLoader:
            return make_loader(8, batch_size=8)

    trainer = quiet_trainer(max_epochs=2, num_sanity_val_steps=0, val_check_interval=2, logger=False)
    with caplog.at_level("INFO", logger="ember"):
        trainer.fit(Planning())
    assert seen == [10] and trainer.global_step == 10  # 5 batches an epoch, known in setup
    said = [record.getMessage() for record in caplog.records if "estimate" in record.getMessage()]
    assert said == ["Loading `train_dataloader` to estimate number of stepping batches."]  # once, as Lightning
    assert asked == ["train"] + [f"validation after {step}" for step in (2, 4, 7, 9)]
    trainer = quiet_trainer(max_epochs=1, logger=False)
    trainer.fit(Planning(), make_loader(24, batch_size=8))  # the loader given to fit is the one counted
    assert seen[-1] == 3


class _Tight(Regressor):
    """Pretends that batches above ``limit`` samples do not fit in memory."""

    def __init__(self, limit: int) -> None:
        super().__init__()
        self.limit, self.refusals = limit, 0

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        if len(batch[0]) > self.limit:
            self.refusals += 1
            raise torch.OutOfMemoryError(f"{len(batch[0])} samples do not fit")
        return super().training_step(batch, batch_idx)


def test_auto_micro_batching_splits_after_running_out_of_memory_and_keeps_the_result(
    capsys: pytest.CaptureFixture[str],
) -> None:
    tight = _Tight(limit=8)
    trainer = quiet_trainer(max_epochs=2, accumulate_grad_batches="auto", logger=False)
    trainer.fit(tight, make_loader(64, batch_size=32))
    assert trainer.fit_loop.runner.micro_batches == 4 and trainer.global_step == 4
    assert tight.refusals == 2  # 32 and 16 samples failed once; the size that worked is remembered
    assert "retrying with 4 micro-batches of about 8 samples" in capsys.readouterr().out
    reference = Regressor()
    quiet_trainer(max_epochs=2, logger=False).fit(reference, make_loader(64, batch_size=32))
    for a, b in zip(parameters_of(tight), parameters_of(reference), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    with pytest.raises(torch.OutOfMemoryError, match="one sample at a time still runs out of memory"):
        quiet_trainer(max_epochs=1, accumulate_grad_batches="auto", logger=False).fit(_Tight(0), make_loader(8))


class _TwoRanks:
    """A strategy of two ranks whose collectives see only this rank: enough for the stop agreement."""

    world_size = 2

    def __init__(self) -> None:
        self.agreements = 0

    def reduce(self, tensor: torch.Tensor, group: object = None, reduce_op: str = "mean") -> torch.Tensor:
        self.agreements += 1
        return tensor


def test_the_stop_check_is_due_alone_only_after_a_signal_or_the_deadline() -> None:
    interruptions = Interruptions()
    interruptions.reset()
    assert not any(interruptions.due() for _ in range(100))
    interruptions.signal_received = signal.SIGTERM
    assert interruptions.due() and interruptions.check(SingleDeviceStrategy()) == (True, signal.SIGTERM)
    interruptions.reset(deadline=time.monotonic())
    assert interruptions.due() and interruptions.check(SingleDeviceStrategy()) == (True, None)


def test_the_ranks_agree_on_stopping_only_when_their_countdown_ends() -> None:
    interruptions, strategy = Interruptions(), _TwoRanks()
    interruptions.reset(world_size=2)
    due = [interruptions.due() for _ in range(10)]
    assert due == [False] * 9 + [True]  # the first agreement comes after 10 steps
    assert interruptions.check(strategy) == (False, None) and strategy.agreements == 1  # type: ignore[arg-type]
    interruptions.signal_received = signal.SIGUSR1  # between agreements a signal waits for the next one
    steps = 1
    while not interruptions.due():
        steps += 1
    assert steps > 1 and interruptions.check(strategy) == (True, signal.SIGUSR1)  # type: ignore[arg-type]


def test_a_step_on_one_device_in_32_bit_calls_the_module_tensor_and_optimizer_directly() -> None:
    trainer = quiet_trainer(max_epochs=1, logger=False, enable_checkpointing=False)
    module = Regressor()
    trainer.fit(module, make_loader(16))
    calls = trainer.strategy.step_calls()
    assert calls.forward == module.training_step and calls.backward is torch.Tensor.backward
    assert calls.unscale is None


def test_a_precision_with_a_context_or_a_profiler_keeps_the_step_going_through_the_strategy() -> None:
    trainer = quiet_trainer(max_epochs=1, logger=False, enable_checkpointing=False, precision="bf16-mixed")
    trainer.fit(Regressor(), make_loader(16))
    forward = trainer.strategy.step_calls().forward
    assert isinstance(forward, functools.partial) and forward.func == trainer.strategy.step  # under autocast

    seen: dict[str, Any] = {}

    class WhileProfiled(Callback):
        def on_train_start(self, trainer: Any, module: Any) -> None:
            seen["calls"] = trainer.strategy.step_calls()

    profiled = quiet_trainer(max_epochs=1, logger=False, enable_checkpointing=False, profiler="simple",
                             callbacks=[WhileProfiled()])  # fmt: skip
    profiled.fit(Regressor(), make_loader(16))
    # The profiler's wrappers stand on the instance: the step must go through them to be timed.
    assert seen["calls"].backward is not torch.Tensor.backward
    assert profiled.profiler.records["backward"].calls == 2  # type: ignore[attr-defined]


def test_batches_skip_the_strategy_only_where_it_would_leave_them_as_they_are() -> None:
    # On the CPU in 32-bit with one process, a batch is used as the loader made it: no call per batch.
    assert quiet_trainer().strategy.batch_transfer() is None
    # A precision that converts the input keeps the transfer, and the steps see converted batches.
    seen: list[torch.dtype] = []

    class Probe(Regressor):
        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            seen.append(batch[0].dtype)
            return super().training_step(batch, batch_idx)

    trainer = quiet_trainer(max_steps=2, logger=False, precision="64-true")
    assert trainer.strategy.batch_transfer() == trainer.strategy.batch_to_device
    trainer.fit(Probe(), make_loader())
    assert seen == [torch.float64, torch.float64]


class _OpenedRanges:
    """The names of the profiler ranges (``record_function``) that torch opens while active."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.names: list[str] = []
        enter = torch.autograd.profiler.record_function.__enter__

        def recording(context: Any) -> Any:
            self.names.append(context.name)
            return enter(context)

        monkeypatch.setattr(torch.autograd.profiler.record_function, "__enter__", recording)


class _GradientsAfterEachStep(Callback):
    """Whether every parameter's gradient was None at the end of each training batch."""

    def __init__(self) -> None:
        self.cleared: list[bool] = []

    def on_train_batch_end(self, trainer: Any, module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        optimizer = trainer.optimizers[0]
        self.cleared.append(all(p.grad is None for group in optimizer.param_groups for p in group["params"]))


def test_gradients_are_reset_after_each_step_without_torchs_profiler_range_unless_a_profiler_records(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The range around torch's zero_grad costs about 5 µs per step whether or not anything records it.
    opened, after_steps = _OpenedRanges(monkeypatch), _GradientsAfterEachStep()
    quiet_trainer(max_steps=3, logger=False, enable_checkpointing=False, callbacks=[after_steps]).fit(
        Regressor(), make_loader()
    )
    assert after_steps.cleared == [True, True, True]
    assert opened.names.count("Optimizer.step#SGD.step") == 3
    assert opened.names.count("Optimizer.zero_grad#SGD.zero_grad") == 0  # in no step, nor before training

    # Under a profiler the reset is torch's own, so that its trace shows the range as always.
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profile:
        quiet_trainer(max_steps=3, logger=False, enable_checkpointing=False).fit(Regressor(), make_loader())
    names = [event.name for event in profile.events()]
    assert names.count("Optimizer.zero_grad#SGD.zero_grad") == 3


class _CountedZeroGrad(torch.optim.SGD):
    """An optimizer with a ``zero_grad`` of its own, which zeroes the gradients in place and counts its calls."""

    calls = 0

    def zero_grad(self, set_to_none: bool = True) -> None:
        type(self).calls += 1
        super().zero_grad(set_to_none=False)


class _GrowingOptimizer(Callback):
    """Adds a parameter group with a parameter of its own after the first batch, as fine-tuning callbacks do."""

    def __init__(self) -> None:
        self.extra = torch.ones(1, requires_grad=True)  # not the module's: in no parameter group until added

    def on_train_batch_end(self, trainer: Any, module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        if batch_idx == 0:
            trainer.optimizers[0].add_param_group({"params": [self.extra]})


def test_an_optimizer_with_its_own_zero_grad_has_it_called_and_added_parameter_groups_are_reset() -> None:
    class OwnReset(Regressor):
        def configure_optimizers(self) -> torch.optim.Optimizer:
            return _CountedZeroGrad(self.parameters(), lr=0.05)

    _CountedZeroGrad.calls = 0
    module = OwnReset()
    quiet_trainer(max_steps=3, logger=False, enable_checkpointing=False).fit(module, make_loader())
    assert _CountedZeroGrad.calls == 3  # after each step (none before training, as in Lightning)
    assert all(p.grad is not None and not p.grad.any() for p in module.parameters())  # zeroed in place, as it does

    class WithExtra(Regressor):
        def __init__(self, extra: torch.Tensor) -> None:
            super().__init__()
            self.extra = extra

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            return super().training_step(batch, batch_idx) + 0.0 * self.extra.sum()

    growing, after_steps = _GrowingOptimizer(), _GradientsAfterEachStep()
    module = WithExtra(growing.extra)
    quiet_trainer(max_steps=3, logger=False, enable_checkpointing=False, callbacks=[after_steps, growing]).fit(
        module, make_loader()
    )
    assert after_steps.cleared == [True, True, True] and growing.extra.grad is None


def test_a_manual_step_resets_gradients_as_zero_grad_does_without_the_profiler_range(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    opened, model = _OpenedRanges(monkeypatch), _Manual()
    trainer = quiet_trainer(max_epochs=1, logger=False, enable_checkpointing=False)
    trainer.fit(model, make_loader(32, batch_size=8))
    assert opened.names.count("Optimizer.step#SGD.step") == 2 * 4
    assert opened.names.count("Optimizer.zero_grad#SGD.zero_grad") == 0  # none, not even before training
    assert all(p.grad is not None for p in model.parameters())  # from the last step: nothing reset them since

    manual = model.optimizers()  # the wrappers; zero_grad works after fit too
    manual[0].zero_grad(set_to_none=False)
    assert all(p.grad is not None and not p.grad.any() for p in model.layer.parameters())
    manual[0].zero_grad()
    assert all(p.grad is None for p in model.layer.parameters())
    assert all(p.grad is not None for p in model.other.parameters())


def test_an_evaluation_asks_for_its_loaders_once_the_checkpoint_is_loaded(tmp_path: Any) -> None:
    calls: list[str] = []

    class Ordered(Regressor):
        def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
            calls.append("on_load_checkpoint")

        def test_step(self, batch: Any, batch_idx: int) -> None:
            pass

        def test_dataloader(self) -> DataLoader:
            calls.append("test_dataloader")
            return make_loader(8)

    trainer = quiet_trainer(max_steps=1, logger=False, default_root_dir=str(tmp_path))
    model = Ordered()
    trainer.fit(model, make_loader(8))
    trainer.save_checkpoint(tmp_path / "one.ckpt")
    trainer.test(model, ckpt_path=str(tmp_path / "one.ckpt"), verbose=False)
    assert calls == ["on_load_checkpoint", "test_dataloader"]  # as in Lightning
