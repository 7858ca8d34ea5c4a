"""The loop's parts: the Progress record, the step runner every trainer of steps shares, the strategy's setup
template and teardown."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F
from conftest import Regressor, make_loader, quiet_trainer

import ember
from ember.loops import Progress, StepRunner
from ember.strategies import (
    DataParallelStrategy,
    DDPStrategy,
    FSDPStrategy,
    ModelParallelStrategy,
    PipelineStrategy,
    SingleDeviceStrategy,
    Strategy,
)
from ember.tuner import Tuner


def test_progress_is_the_one_record_of_where_fit_is() -> None:
    trainer = quiet_trainer(max_epochs=2, accumulate_grad_batches=3, logger=False, enable_checkpointing=False)
    trainer.fit(Regressor(), make_loader(64, batch_size=8))  # 8 batches: windows of 3, 3 and 2
    progress = trainer.fit_loop.progress
    assert (trainer.global_step, trainer.current_epoch) == (progress.global_step, progress.epoch) == (6, 2)
    assert progress.total_batches == 16 and progress.epoch_batches == 0 and progress.window_batches == 0
    copy = Progress()
    copy.load_state_dict(progress.state_dict())
    assert copy == progress


def test_progress_counts_the_samples_of_the_epoch_and_the_window_position() -> None:
    seen: list[tuple[int, int, int]] = []

    class Probe(ember.callbacks.Callback):
        def on_train_batch_end(self, trainer: ember.Trainer, module: Any, outputs: Any, batch: Any, idx: int) -> None:
            progress = trainer.fit_loop.progress
            seen.append((progress.epoch_batches, progress.window_batches, progress.epoch_samples))

    trainer = quiet_trainer(max_epochs=1, accumulate_grad_batches=2, logger=False, callbacks=[Probe()])
    trainer.fit(Regressor(), make_loader(20, batch_size=8))  # batches of 8, 8 and 4
    assert seen == [(1, 1, 8), (2, 0, 16), (3, 0, 20)]


def test_an_epoch_end_checkpoint_resumes_at_the_next_epoch() -> None:
    progress = Progress(epoch=3, global_step=12, epoch_batches=4, epoch_samples=32, epoch_finished=True)
    progress.load_state_dict(progress.state_dict())
    assert (progress.epoch, progress.epoch_batches, progress.epoch_samples, progress.global_step) == (4, 0, 0, 12)


def test_the_tuner_runs_fits_step_runner(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[str] = []
    original = StepRunner.step

    def counted(self: StepRunner, *args: Any) -> Any:
        calls.append("step")
        return original(self, *args)

    monkeypatch.setattr(StepRunner, "step", counted)

    class Finder(Regressor):
        def train_dataloader(self) -> Any:
            return make_loader(64, batch_size=8)

    Tuner(quiet_trainer(logger=False)).lr_find(Finder(), num_training=5, early_stop_threshold=None)
    assert calls == ["step"] * 5


class _CountingStrategy(SingleDeviceStrategy):
    def __init__(self) -> None:
        super().__init__()
        self.teardowns = 0

    def teardown(self) -> None:
        self.teardowns += 1
        super().teardown()


def test_teardown_runs_after_every_stage_and_after_an_exception() -> None:
    strategy = _CountingStrategy()
    trainer = quiet_trainer(strategy=strategy, max_epochs=1, logger=False)
    trainer.fit(Regressor(), make_loader(16))
    trainer.validate(Regressor(), make_loader(16), verbose=False)
    assert strategy.teardowns == 2

    class Broken(Regressor):
        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            raise RuntimeError("broken step")

    strategy = _CountingStrategy()
    trainer = quiet_trainer(strategy=strategy, max_epochs=1, logger=False)
    with pytest.raises(RuntimeError, match="broken step"):
        trainer.fit(Broken(), make_loader(16))
    assert strategy.teardowns == 1 and trainer.stage is None


def test_the_setup_template_sends_batches_to_the_strategys_device_whatever_its_layout() -> None:
    class ShardsElsewhere(Strategy):
        """A layout that leaves the module where it is (as sharding does), on a device batches must reach."""

        def lay_out(self, module: ember.Module) -> None:
            pass

    strategy = ShardsElsewhere()
    strategy.parallel_devices = [torch.device("meta")]
    strategy.setup_module(Regressor(), training=True)
    batch = strategy.batch_to_device((torch.ones(2, 4), torch.ones(2, 1)))
    assert all(tensor.device.type == "meta" for tensor in batch)


@pytest.mark.parametrize("strategy_class", [SingleDeviceStrategy, DDPStrategy, FSDPStrategy, ModelParallelStrategy,
                                            PipelineStrategy, DataParallelStrategy])  # fmt: skip
def test_every_strategy_sends_batches_to_its_device(
    strategy_class: type[Strategy], monkeypatch: pytest.MonkeyPatch
) -> None:
    """FSDP, model parallel and pipeline lay the module out themselves; batches must still reach the GPU."""
    monkeypatch.setattr(strategy_class, "lay_out", lambda self, module: None)  # the layout needs GPUs or a group
    strategy = strategy_class()
    strategy.parallel_devices = [torch.device("meta")]  # stands in for the GPU: not where the loader makes batches
    strategy.setup_module(Regressor(), training=False)
    batch = strategy.batch_to_device((torch.ones(2, 4), torch.ones(2, 1)))
    assert all(tensor.device.type == "meta" for tensor in batch)


@pytest.mark.parametrize("strategy_class", [SingleDeviceStrategy, DDPStrategy, FSDPStrategy])
def test_checkpoints_are_read_into_cpu_memory(strategy_class: type[Strategy], monkeypatch: pytest.MonkeyPatch) -> None:
    """Each part's load_state_dict places its tensors; random generator states must stay on the CPU (the NumPy
    generator's key is read back with .numpy()). Resuming and elastic restarts read checkpoints this way."""
    seen: list[Any] = []
    monkeypatch.setattr("ember.checkpoint.load_file", lambda path, map_location, **_: seen.append(map_location))
    strategy = strategy_class()
    strategy.parallel_devices = [torch.device("cuda", 0)]
    strategy.load_checkpoint(__file__)
    assert seen == ["cpu"]


def test_outputs_that_the_next_step_overwrites_are_copied(monkeypatch: pytest.MonkeyPatch) -> None:
    """Under CUDA graphs a forward's outputs live in memory the next replay overwrites: the losses and
    logged values kept across steps must be copies (shown with a module that overwrites its last loss)."""

    class Overwriting(Regressor):
        previous: torch.Tensor | None = None

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            if self.previous is not None:
                with torch.no_grad():
                    self.previous.fill_(-1.0)  # what the next replay does to the last step's output
            x, y = batch
            loss = F.mse_loss(self(x), y)
            self.log("loss", loss)
            self.previous = loss
            return loss

    monkeypatch.setattr(Strategy, "reuses_outputs", property(lambda self: True))
    kept: list[torch.Tensor] = []

    class Keep(ember.callbacks.Callback):
        def on_train_batch_end(self, trainer: ember.Trainer, module: Any, outputs: Any, batch: Any, idx: int) -> None:
            kept.extend([trainer.fit_loop.last_loss, trainer.callback_metrics["loss"]])  # type: ignore[list-item]

    quiet_trainer(max_epochs=1, logger=False, callbacks=[Keep()]).fit(Overwriting(), make_loader(32, batch_size=8))
    assert len(kept) == 8 and all(float(value) >= 0 for value in kept)


def test_predictions_are_moved_to_the_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    moved: list[torch.Tensor] = []

    def to_cpu(tensor: torch.Tensor) -> torch.Tensor:
        moved.append(tensor)
        return tensor

    class Predictor(Regressor):
        def predict_step(self, batch: Any, batch_idx: int, dataloader_idx: int = 0) -> torch.Tensor:
            return self(batch[0])

    monkeypatch.setattr("ember.loops.evaluate._to_cpu", to_cpu)
    predictions = quiet_trainer(logger=False).predict(Predictor(), make_loader(16, batch_size=8))
    assert predictions is not None and len(predictions) == 2 and len(moved) == 2


def test_predict_returns_by_default_with_none_too_and_warns_once_of_a_step_that_returns_none() -> None:
    class Sparse(Regressor):
        def predict_step(self, batch: Any, batch_idx: int) -> torch.Tensor | None:
            return None if batch_idx % 2 else self(batch[0])

    trainer = quiet_trainer(logger=False)
    with pytest.warns(UserWarning, match="predict returned None") as caught:
        predictions = trainer.predict(Sparse(), make_loader(32, batch_size=8), return_predictions=None)
    assert predictions is not None and len(predictions) == 4 and predictions[1] is None
    assert sum("predict returned None" in str(warning.message) for warning in caught) == 1


@pytest.mark.parametrize("return_predictions", [True, False])
def test_the_copies_of_predictions_are_waited_for_before_a_writer_reads_them(
    monkeypatch: pytest.MonkeyPatch, return_predictions: bool
) -> None:
    """The copies to the CPU do not wait for the device: whatever reads the predictions must wait first."""
    from ember.callbacks import BasePredictionWriter

    events: list[str] = []

    class Writer(BasePredictionWriter):
        def write_on_epoch_end(self, trainer: Any, module: Any, predictions: Any, batch_indices: Any) -> None:
            events.append(f"read {len(predictions)}")

    class Predictor(Regressor):
        def predict_step(self, batch: Any, batch_idx: int, dataloader_idx: int = 0) -> torch.Tensor:
            return self(batch[0])

    monkeypatch.setattr("ember.loops.evaluate._wait_for_copies", lambda device: events.append("wait"))
    trainer = quiet_trainer(logger=False, callbacks=[Writer(write_interval="epoch")])
    trainer.predict(Predictor(), make_loader(16, batch_size=8), return_predictions=return_predictions)
    assert events == ["wait", "read 2"]


@pytest.mark.parametrize(
    ("options", "device", "expected"),
    [
        ({"mode": "reduce-overhead"}, "cuda", True),
        ({"mode": "max-autotune"}, "cuda", True),
        ({"options": {"triton.cudagraphs": True}}, "cuda", True),
        ({"mode": "default"}, "cuda", False),
        ({"mode": "reduce-overhead"}, "cpu", False),
        (None, "cuda", False),
    ],
)
def test_which_compile_modes_reuse_their_outputs(options: Any, device: str, expected: bool) -> None:
    strategy = SingleDeviceStrategy()
    strategy.parallel_devices = [torch.device(device, 0) if device == "cuda" else torch.device("cpu")]
    strategy.compile_options = options
    assert strategy.reuses_outputs is expected
