"""ModelCheckpoint, EarlyStopping, atomic writes, safe loading and resuming from ckpt_path."""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import os
import time
import warnings
from datetime import timedelta
from typing import Any

import pytest
import torch
from conftest import Regressor, make_loader, parameters_of, quiet_trainer

import ember
from ember import checkpoint as checkpoint_io
from ember.callbacks import EarlyStopping, ModelCheckpoint
from ember.exceptions import MisconfigurationException


class _Scripted(Regressor):
    """Logs a scripted validation score per epoch, so checkpoint choices are known in advance."""

    def __init__(self, scores: list[float]) -> None:
        super().__init__()
        self.scores = scores

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        self.log("score", self.scores[self.current_epoch])


def _files(directory: str) -> list[str]:
    return sorted(os.listdir(directory))


def test_top_k_by_monitor_and_last(tmp_path: Any) -> None:
    checkpoint = ModelCheckpoint(dirpath=str(tmp_path), monitor="score", mode="max", save_top_k=2, save_last=True,
                                 filename="{epoch}-{score:.1f}")  # fmt: skip
    trainer = quiet_trainer(max_epochs=5, callbacks=[checkpoint], logger=False)
    trainer.fit(_Scripted([0.1, 0.5, 0.3, 0.9, 0.2]), make_loader(16), make_loader(8))
    assert _files(str(tmp_path)) == ["epoch=1-score=0.5.ckpt", "epoch=3-score=0.9.ckpt", "last.ckpt"]
    assert checkpoint.best_model_path.endswith("epoch=3-score=0.9.ckpt")
    assert checkpoint.best_model_score is not None and checkpoint.best_model_score.item() == pytest.approx(0.9)
    last = checkpoint_io.load(checkpoint.last_model_path)
    assert last["epoch"] == 4 and last["global_step"] == 10


def test_latest_files_by_monitoring_the_step_with_a_step_trigger(tmp_path: Any) -> None:
    checkpoint = ModelCheckpoint(dirpath=str(tmp_path), every_n_train_steps=3, save_top_k=2, monitor="step", mode="max")
    trainer = quiet_trainer(max_epochs=2, callbacks=[checkpoint], logger=False)
    trainer.fit(Regressor(), make_loader(64))  # 16 steps: saves at 3, 6, ..., 15
    assert _files(str(tmp_path)) == ["epoch=1-step=12.ckpt", "epoch=1-step=15.ckpt"]


def test_default_checkpoint_lives_in_the_logger_directory() -> None:
    trainer = quiet_trainer(max_epochs=2)
    trainer.fit(Regressor(), make_loader(16))
    directory = os.path.join(trainer.log_dir, "checkpoints")
    assert _files(directory) == ["epoch=1-step=4.ckpt"]  # the latest only


def test_checkpoint_holds_the_training_state() -> None:
    trainer = quiet_trainer(max_epochs=1)
    trainer.fit(Regressor(lr=0.03), make_loader(16))
    state = checkpoint_io.load(trainer.checkpoint_callback.best_model_path)
    expected = {
        "state_dict", "optimizer_states", "lr_schedulers", "callbacks", "hyper_parameters", "loops", "precision",
        "loggers", "data", "ranks", "ember_version", "torch_version", "epoch", "global_step",
    }  # fmt: skip
    assert expected <= set(state)
    assert state["hyper_parameters"] == {"lr": 0.03, "features": 4}
    # The loop's progress: epoch 0 is finished (a resume starts epoch 1 at its first batch), 2 batches in all.
    progress = state["loops"]["fit_loop"]["progress"]
    assert progress["epoch"] == 0 and progress["epoch_finished"] and progress["total_batches"] == 2
    assert state["loops"]["fit_loop"]["micro_batches"] == 1
    # The default loggers (TensorBoard when installed, and CSV) share one run directory.
    assert state["loggers"] and all(saved == {"version": 0} for saved in state["loggers"])
    assert isinstance(state["data"]["seed"], int)
    assert set(state["ranks"]) == {0} and {"python", "torch", "numpy"} <= set(state["ranks"][0]["random_state"])


def test_resume_continues_where_the_run_stopped(tmp_path: Any) -> None:
    class Momentum(Regressor):
        def configure_optimizers(self) -> Any:
            optimizer = torch.optim.SGD(self.parameters(), lr=0.02, momentum=0.9)
            return [optimizer], [torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.7)]

    uninterrupted = Momentum()
    quiet_trainer(max_epochs=4, logger=False, enable_checkpointing=False).fit(uninterrupted, make_loader(32))

    checkpoint = ModelCheckpoint(dirpath=str(tmp_path), save_last=True)
    first = Momentum()
    quiet_trainer(max_epochs=2, logger=False, callbacks=[checkpoint]).fit(first, make_loader(32))
    resumed = Momentum()
    trainer = quiet_trainer(max_epochs=4, logger=False, enable_checkpointing=False)
    trainer.fit(resumed, make_loader(32), ckpt_path=checkpoint.last_model_path)
    assert trainer.global_step == 16 and trainer.current_epoch == 4
    assert trainer.optimizers[0].param_groups[0]["lr"] == pytest.approx(0.02 * 0.7**4)
    for a, b in zip(parameters_of(resumed), parameters_of(uninterrupted), strict=True):
        assert torch.equal(a, b)


def test_where_a_run_resumes_is_said_while_other_processes_write_and_remove_files_beside_it(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Another rank's write check, or a save replacing a file, can vanish between the listing of the checkpoint
    directory and the look at each name: where the run resumes is still said, with the names "last" also has."""
    first = quiet_trainer(max_epochs=1, logger=False, default_root_dir=str(tmp_path),
                          callbacks=[ModelCheckpoint(save_last=True)])  # fmt: skip
    first.fit(Regressor(), make_loader(16))
    directory = str(tmp_path / "checkpoints")
    listdir = os.listdir

    def listing_with_files_removed_meanwhile(path: Any = ".") -> list[str]:
        names = listdir(path)
        vanished = [".write-check.1.0a1b2c3d", "epoch=7-step=99.ckpt"]
        return sorted(names + vanished) if os.path.abspath(path) == directory else names

    monkeypatch.setattr(os, "listdir", listing_with_files_removed_meanwhile)
    trainer = quiet_trainer(max_epochs=2, logger=False, default_root_dir=str(tmp_path))
    trainer.fit(Regressor(), make_loader(16), ckpt_path="last")
    assert trainer.current_epoch == 2
    said = capsys.readouterr().out
    assert f"resuming from {directory}/last.ckpt (also epoch=0-step=2.ckpt)" in said, said


def test_weights_only_checkpoint_cannot_resume_but_loads_into_a_module(tmp_path: Any) -> None:
    checkpoint = ModelCheckpoint(dirpath=str(tmp_path), save_weights_only=True)
    trained = Regressor(lr=0.07)
    quiet_trainer(max_epochs=1, logger=False, callbacks=[checkpoint]).fit(trained, make_loader(16))
    with pytest.raises(ValueError, match="holds weights only"):
        quiet_trainer(max_epochs=2, logger=False).fit(
            Regressor(), make_loader(16), ckpt_path=checkpoint.best_model_path
        )
    loaded = Regressor.load_from_checkpoint(checkpoint.best_model_path)
    assert loaded.hparams.lr == 0.07
    for a, b in zip(parameters_of(loaded), parameters_of(trained), strict=True):
        assert torch.equal(a, b)


def test_atomic_save_replaces_the_file_and_leaves_no_temporary(tmp_path: Any) -> None:
    path = tmp_path / "a.ckpt"
    checkpoint_io.save({"x": torch.ones(2)}, path)
    checkpoint_io.save({"x": torch.zeros(2)}, path)
    assert os.listdir(tmp_path) == ["a.ckpt"]
    assert torch.equal(checkpoint_io.load(path)["x"], torch.zeros(2))
    path.write_bytes(path.read_bytes()[:20])  # a truncated file
    with pytest.raises(checkpoint_io.CheckpointError, match="not a readable checkpoint"):
        checkpoint_io.load(path)


_O_DIRECT = getattr(os, "O_DIRECT", 0)


def _is_direct(fd: int) -> bool:
    return bool(_O_DIRECT) and bool(fcntl.fcntl(fd, fcntl.F_GETFL) & _O_DIRECT)


def _takes_direct_writes(directory: Any) -> bool:
    if not _O_DIRECT:
        return False
    try:
        os.close(os.open(directory / "probe", os.O_WRONLY | os.O_CREAT | _O_DIRECT))
    except OSError:
        return False
    finally:
        with contextlib.suppress(OSError):
            os.unlink(directory / "probe")
    return True


def _saved_and_loaded(path: Any) -> None:
    """Save a checkpoint larger than the writer's 4 MiB buffer and not a whole number of blocks; it must load
    exactly, its trailer's length and digest verified."""
    weights = torch.arange(1_500_001, dtype=torch.float32)
    checkpoint_io.save({"weights": weights}, path)
    assert os.listdir(path.parent) == [path.name]
    assert checkpoint_io.verify(path) is True
    assert torch.equal(checkpoint_io.load(path)["weights"], weights)


def test_a_save_writes_around_the_page_cache_where_the_file_system_allows(tmp_path: Any, monkeypatch: Any) -> None:
    directs: list[bool] = []
    write = os.write

    def spy(fd: int, data: Any) -> int:
        directs.append(_is_direct(fd))
        return write(fd, data)

    monkeypatch.setattr(os, "write", spy)
    _saved_and_loaded(tmp_path / "a.ckpt")
    if _takes_direct_writes(tmp_path):
        assert any(directs)


def test_a_file_system_that_refuses_direct_io_at_open_gets_the_file_through_the_cache(
    tmp_path: Any, monkeypatch: Any
) -> None:
    opened = os.open

    def refusing(path: Any, flags: int, *args: Any) -> int:
        if flags & _O_DIRECT:
            raise OSError(errno.EINVAL, "Invalid argument")
        return opened(path, flags, *args)

    monkeypatch.setattr(os, "open", refusing)
    _saved_and_loaded(tmp_path / "a.ckpt")


def test_a_disk_that_refuses_a_direct_write_gets_the_rest_through_the_cache(tmp_path: Any, monkeypatch: Any) -> None:
    write, refused = os.write, []

    def refusing(fd: int, data: Any) -> int:
        if _is_direct(fd) and not refused:  # the first direct write, as larger blocks than 4 KiB would be
            refused.append(fd)
            raise OSError(errno.EINVAL, "Invalid argument")
        return write(fd, data)

    monkeypatch.setattr(os, "write", refusing)
    _saved_and_loaded(tmp_path / "a.ckpt")
    assert bool(refused) == _takes_direct_writes(tmp_path)


def test_a_save_digests_while_the_disk_writes(tmp_path: Any, monkeypatch: Any) -> None:
    digested: list[int] = []
    sha256 = hashlib.sha256

    class Counted:
        """SHA-256, counting its updates."""

        def __init__(self) -> None:
            self._digest = sha256()

        def update(self, data: Any) -> None:
            self._digest.update(data)
            digested.append(len(data))

        def digest(self) -> bytes:
            return self._digest.digest()

    write, overlapped = os.write, []

    def slow_first_write(fd: int, data: Any) -> int:
        if not overlapped:  # the first write waits for more to be digested (in vain if the two take turns)
            before, deadline = len(digested), time.monotonic() + 10
            while len(digested) == before and time.monotonic() < deadline:
                time.sleep(0.01)
            overlapped.append(len(digested) > before)
        return write(fd, data)

    monkeypatch.setattr(hashlib, "sha256", Counted)
    monkeypatch.setattr(os, "write", slow_first_write)
    weights = torch.arange(3_000_001, dtype=torch.float32)  # three buffers of 4 MiB, the last one partly
    path = tmp_path / "a.ckpt"
    checkpoint_io.save({"weights": weights}, path)
    assert overlapped == [True]
    assert checkpoint_io.verify(path) and torch.equal(checkpoint_io.load(path)["weights"], weights)


def test_a_failed_disk_write_in_the_middle_of_a_save_names_the_file_and_keeps_the_previous_one(
    tmp_path: Any, monkeypatch: Any
) -> None:
    path = tmp_path / "a.ckpt"
    checkpoint_io.save({"weights": torch.zeros(3)}, path)
    write, writes = os.write, []

    def filling_up(fd: int, data: Any) -> int:
        writes.append(len(data))
        if len(writes) == 3:  # while buffers before and after it are in flight
            raise OSError(errno.ENOSPC, "No space left on device")
        return write(fd, data)

    monkeypatch.setattr(os, "write", filling_up)
    with pytest.raises(checkpoint_io.CheckpointError, match=r"a\.ckpt.*No space left.*previous file is intact"):
        checkpoint_io.save({"weights": torch.arange(10_000_000, dtype=torch.float32)}, path)  # 40 MB: 10 buffers
    monkeypatch.undo()
    assert _files(tmp_path) == ["a.ckpt"]  # no temporary file left behind
    assert torch.equal(checkpoint_io.load(path)["weights"], torch.zeros(3))


class _Payload:
    """Pickling this object makes loading it run code: what a malicious checkpoint does."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self) -> Any:
        return (open, (self.marker, "w"))


def test_pickled_objects_are_refused_and_never_run(tmp_path: Any) -> None:
    marker = tmp_path / "payload-ran"
    path = tmp_path / "evil.ckpt"
    torch.save({"state_dict": {}, "payload": _Payload(str(marker))}, path)
    with pytest.raises(checkpoint_io.CheckpointError, match="it references io.open"):
        checkpoint_io.load(path)
    with pytest.raises(checkpoint_io.CheckpointError, match="weights_only=False"):
        quiet_trainer(max_epochs=1, logger=False).fit(Regressor(), make_loader(), ckpt_path=str(path))
    assert not marker.exists()


def test_unstorable_hyperparameters_are_left_out_with_a_warning() -> None:
    class WithObject(Regressor):
        def __init__(self, lr: float = 0.05, loss_fn: Any = None) -> None:
            super().__init__(lr)
            self.save_hyperparameters()

    trainer = quiet_trainer(max_epochs=1, logger=False)
    with pytest.warns(UserWarning, match=r"hyper_parameters\['loss_fn'\] is a MSELoss"):
        trainer.fit(WithObject(loss_fn=torch.nn.MSELoss()), make_loader(16))
    path = trainer.checkpoint_callback.best_model_path
    # The parent's hyperparameters stay (features); rebuilding passes only what __init__ takes.
    assert checkpoint_io.load(path)["hyper_parameters"] == {"lr": 0.05, "features": 4}
    assert WithObject.load_from_checkpoint(path).hparams == {"lr": 0.05, "features": 4, "loss_fn": None}


def test_early_stopping_stops_after_patience_and_saves_its_state(tmp_path: Any) -> None:
    stopper = EarlyStopping(monitor="score", mode="max", patience=2)
    checkpoint = ModelCheckpoint(dirpath=str(tmp_path), save_last=True)
    trainer = quiet_trainer(max_epochs=10, callbacks=[stopper, checkpoint], logger=False)
    trainer.fit(_Scripted([0.1, 0.5, 0.4, 0.45, 0.9, 0.9, 0.9, 0.9, 0.9, 0.9]), make_loader(16), make_loader(8))
    assert trainer.current_epoch == 4 and stopper.stopped_epoch == 3 and trainer.should_stop
    state = checkpoint_io.load(checkpoint.last_model_path)["callbacks"][stopper.state_key]
    assert state["wait_count"] == 2 and state["best_score"] == pytest.approx(0.5)


def test_monitoring_a_metric_that_was_never_logged_is_a_clear_error() -> None:
    # Lightning's types and words: a RuntimeError for EarlyStopping, a MisconfigurationException for ModelCheckpoint
    with pytest.raises(RuntimeError, match=r"metric `nope` which is not available.*following: `score`.*strict=False"):
        quiet_trainer(max_epochs=1, callbacks=[EarlyStopping("nope")], logger=False).fit(
            _Scripted([0.1]), make_loader(16), make_loader(8)
        )
    with pytest.raises(MisconfigurationException, match=r"ModelCheckpoint\(monitor='nope'\)` could not find.*'score'"):
        quiet_trainer(max_epochs=1, callbacks=[ModelCheckpoint(monitor="nope")], logger=False).fit(
            _Scripted([0.1]), make_loader(16), make_loader(8)
        )


def test_a_monitored_metric_missing_before_the_first_validation_warns_and_saves_no_top_k_file(tmp_path: Any) -> None:
    # Saved every step, before any validation: the score may be one that validation logs, so not yet an error.
    checkpoint = ModelCheckpoint(dirpath=str(tmp_path), monitor="score", every_n_train_steps=1, save_last=True)
    with pytest.warns(UserWarning, match=r"monitor='score'\)` could not find the monitored key.*no top-k"):
        quiet_trainer(max_steps=2, callbacks=[checkpoint], logger=False).fit(_Scripted([0.5]), make_loader(16))
    assert checkpoint.best_k_models == {} and _files(str(tmp_path)) == ["last.ckpt"]


@pytest.mark.parametrize("trigger", [{"every_n_train_steps": 2}, {"train_time_interval": timedelta(0)}])
def test_a_save_due_by_step_or_time_waits_for_the_validation_that_scores_it(trigger: Any, tmp_path: Any) -> None:
    # Validation every other epoch (2 steps each): a save due before it, or at the step just before it, is ranked
    # by that validation's score, never by a stale one or none.
    checkpoint = ModelCheckpoint(dirpath=str(tmp_path), monitor="score", mode="max", **trigger)
    trainer = quiet_trainer(max_epochs=4, check_val_every_n_epoch=2, callbacks=[checkpoint], logger=False)
    trainer.fit(_Scripted([0.1, 0.5, 1.0, 3.0]), make_loader(16), make_loader(8))
    assert checkpoint.best_model_score is not None and checkpoint.best_model_score.item() == 3.0
    assert _files(str(tmp_path)) == ["epoch=3-step=8.ckpt"]


class _Counter(ember.callbacks.Callback):
    def state_dict(self) -> dict[str, Any]:
        return {"count": 1}


def test_resuming_without_a_callback_whose_state_the_checkpoint_holds_warns_naming_it(tmp_path: Any) -> None:
    root = str(tmp_path)
    quiet_trainer(max_epochs=1, default_root_dir=root, callbacks=[_Counter()]).fit(Regressor(), make_loader(16))
    with pytest.warns(UserWarning, match=r"Please add the following callbacks: \['_Counter'\]") as warned:
        quiet_trainer(max_epochs=2, default_root_dir=root, log_every_n_steps=1).fit(
            Regressor(), make_loader(16), ckpt_path="last"
        )
    assert [warning.filename for warning in warned if "Please add" in str(warning.message)] == [__file__]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # every saved state has its callback (an empty state would lose nothing)
        warnings.filterwarnings("ignore", "You defined a `validation_step` but have no `val_dataloader`")
        quiet_trainer(max_epochs=3, default_root_dir=root, callbacks=[_Counter()], log_every_n_steps=1).fit(
            Regressor(), make_loader(16), ckpt_path="last"
        )


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"mode": "avg"}, "mode='avg'"),
        ({"save_top_k": -2}, "save_top_k=-2"),
        ({"every_n_train_steps": 2, "every_n_epochs": 1}, "should be mutually exclusive"),
    ],
)
def test_bad_model_checkpoint_options(options: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        ModelCheckpoint(**options)


class _CountedBatchEnds(ModelCheckpoint):
    calls = 0

    def on_train_batch_end(self, trainer: Any, module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        type(self).calls += 1
        super().on_train_batch_end(trainer, module, outputs, batch, batch_idx)


class _BatchEndCallees(ember.callbacks.Callback):
    """Notes which objects the loop calls on_train_batch_end of."""

    def on_train_end(self, trainer: Any, module: Any) -> None:
        self.callees = [hook.func.__self__ for hook in trainer.hooks.implementations("on_train_batch_end")]


@pytest.mark.parametrize("schedule", [{}, {"every_n_train_steps": 2}, {"train_time_interval": timedelta(hours=1)}])
def test_the_batch_hook_of_model_checkpoint_runs_only_when_it_saves_per_step(
    schedule: dict[str, Any], tmp_path: Any
) -> None:
    probe = _BatchEndCallees()
    trainer = quiet_trainer(max_epochs=1, logger=False, callbacks=[ModelCheckpoint(**schedule), probe])
    trainer.fit(Regressor(), make_loader())
    assert any(isinstance(callee, ModelCheckpoint) for callee in probe.callees) == bool(schedule)
    # A subclass's own batch hook is called whatever the schedule, and its parent's saving still runs in it.
    _CountedBatchEnds.calls = 0
    counted = _CountedBatchEnds(dirpath=str(tmp_path / "counted"), every_n_train_steps=4, save_top_k=-1)
    quiet_trainer(max_epochs=1, logger=False, callbacks=[counted]).fit(Regressor(), make_loader())
    assert _CountedBatchEnds.calls == 8
    assert _files(str(tmp_path / "counted")) == ["epoch=0-step=4.ckpt", "epoch=0-step=8.ckpt"]


@pytest.mark.parametrize("save_last", [None, "link"])
def test_a_checkpoint_directory_on_another_file_system_is_refused_when_fit_starts(save_last: Any) -> None:
    checkpoint = ModelCheckpoint(dirpath="s3://bucket/run", save_last=save_last)
    assert checkpoint.dirpath == "s3://bucket/run"  # kept as given, not made a local path
    checkpoint.setup(ember.Trainer(logger=False), Regressor(), stage="validate")  # no files to write there
    with pytest.raises(ValueError, match=rf"save_last={save_last!r}\): .* only supported for local file paths"):
        quiet_trainer(max_epochs=1, callbacks=[checkpoint], logger=False).fit(Regressor(), make_loader(16))


def test_a_file_url_is_a_local_checkpoint_directory(tmp_path: Any) -> None:
    assert ModelCheckpoint(dirpath=f"file://{tmp_path}").dirpath == os.path.realpath(tmp_path)


def test_resuming_a_run_past_max_epochs_is_refused_and_one_that_reached_it_has_nothing_to_train(
    tmp_path: Any,
) -> None:
    root = str(tmp_path)
    quiet_trainer(max_epochs=3, default_root_dir=root, logger=False).fit(Regressor(), make_loader(16))
    with pytest.raises(MisconfigurationException, match=r"current_epoch=3, but you have set Trainer\(max_epochs=2\)"):
        quiet_trainer(max_epochs=2, default_root_dir=root, logger=False).fit(
            Regressor(), make_loader(16), ckpt_path="last"
        )
    reached = quiet_trainer(max_epochs=3, default_root_dir=root, logger=False)
    reached.fit(Regressor(), make_loader(16), ckpt_path="last")
    assert reached.current_epoch == 3 and reached.global_step == 6
