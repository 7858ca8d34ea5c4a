"""Resume that survives a changed setup: a run killed mid-epoch continues at the very sample it stopped at,
with another number of processes, batch size or accumulation; a changed dataset or seed is refused."""

from __future__ import annotations

import collections
import json
import math
import os
import subprocess
import sys
from typing import Any

import pytest
import torch
import warm_processes
from conftest import Regressor, make_data, make_loader, parameters_of, quiet_trainer
from torch.utils.data import DataLoader, default_collate

import ember
from ember import checkpoint as checkpoint_io
from ember.callbacks import Callback
from ember.data import EpochOrder

SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "scripts", "resume_layout.py")
SAMPLES = 48


def _launch(out: str, devices: int, *args: str) -> subprocess.CompletedProcess:
    launcher = (
        [sys.executable, "-m", "ember", "run", "--nproc-per-node", str(devices)] if devices > 1 else [sys.executable]
    )
    command = [*launcher, SCRIPT, "--out", out, "--devices", str(devices), *args]
    return warm_processes.run(command, cwd=out, capture_output=True, text=True, timeout=150)


def _rows(out: str, tag: str, devices: int) -> list[list[Any]]:
    rows = []
    for rank in range(devices):
        with open(os.path.join(out, f"{tag}-rank{rank}.json")) as file:
            rows.append(json.load(file))
    return rows


# (processes, batch size, accumulation) before and after, the step to kill the first run after (odd: the
# checkpoint two steps before it is the last one saved), and more options of the script.
SCENARIOS = {
    "2->1": ((2, 4, 1), (1, 4, 1), 3, ()),
    "1->2, FSDP with Adam": ((1, 8, 1), (2, 4, 1), 3, ("--strategy", "fsdp", "--adam")),
    "2->2, half the batch": ((2, 4, 1), (2, 2, 1), 3, ()),
    "1->1, accumulation 1->2": ((1, 4, 1), (1, 4, 2), 5, ()),
}
Layout = tuple[int, int, int]


def _options(layout: Layout, extra: tuple[str, ...]) -> list[str]:
    _, batch, accumulate = layout
    return ["--batch-size", str(batch), "--accumulate", str(accumulate), *extra]


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("scenario", SCENARIOS)
def test_a_run_killed_mid_epoch_resumes_at_the_sample_with_another_layout(scenario: str, tmp_path: Any) -> None:
    before, after, kill_after, extra = SCENARIOS[scenario]
    out = str(tmp_path / "killed")
    os.makedirs(out)
    killed = _launch(out, before[0], *_options(before, extra), "--kill-after", str(kill_after), "--tag", "first")
    assert killed.returncode != 0  # SIGKILL
    last = checkpoint_io.load(os.path.join(out, "checkpoints", "last.ckpt"))
    progress = last["loops"]["fit_loop"]["progress"]
    assert progress["epoch"] == 0 and 0 < progress["epoch_samples"] < SAMPLES  # mid-epoch
    resumed = _launch(out, after[0], *_options(after, extra), "--ckpt-path", "last", "--tag", "second")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"continues at sample {progress['epoch_samples']}" in resumed.stdout

    # Epoch 0: what the checkpoint holds of the first run, and what the second run read, is every sample once.
    before_rows = [row for rows in _rows(out, "first", before[0]) for row in rows[: progress["epoch_batches"]]]
    after_rows = [row for rows in _rows(out, "second", after[0]) for row in rows if row[0] == 0]
    used = collections.Counter(index for row in before_rows + after_rows for index in row[2])
    assert used == collections.Counter(range(SAMPLES))

    # Epoch 1 is read as an uninterrupted run with the new layout reads it.
    for rank, rows in enumerate(_rows(out, "second", after[0])):
        order = EpochOrder(SAMPLES, shuffle=True, num_replicas=after[0], rank=rank)
        order.seed, order.epoch = last["data"]["seed"], 1
        expected = list(order)
        assert [index for row in rows if row[0] == 1 for index in row[2]] == expected

    reference = str(tmp_path / "reference")
    os.makedirs(reference)
    if math.prod(before) == math.prod(after):
        # Each optimizer step reads the same samples before and after: the resumed run ends as an uninterrupted
        # run with the new layout ends (the model and optimizer states resharded).
        assert _launch(reference, after[0], *_options(after, extra), "--tag", "second").returncode == 0
        uninterrupted = torch.load(os.path.join(reference, "second-final.pt"))
        for got, expected in zip(torch.load(os.path.join(out, "second-final.pt")), uninterrupted, strict=True):
            torch.testing.assert_close(got, expected, rtol=0, atol=1e-6)  # ranks may add up in another order
        return
    # Otherwise the resumed run ends, bit for bit, as the same history without a kill: the first layout up to the
    # checkpoint's step, then the second.
    until_saved = ("--max-steps", str(last["global_step"]), "--tag", "first")
    assert _launch(reference, before[0], *_options(before, extra), *until_saved).returncode == 0
    resumed_clean = _launch(reference, after[0], *_options(after, extra), "--ckpt-path", "last", "--tag", "second")
    assert resumed_clean.returncode == 0, resumed_clean.stderr[-3000:]
    killed = torch.load(os.path.join(out, "second-final.pt"))
    clean = torch.load(os.path.join(reference, "second-final.pt"))
    assert all(torch.equal(a, b) for a, b in zip(killed, clean, strict=True))


# ------------------------------------------------------------------------------ changed data or seed
def _checkpoint_of_a_run(tmp_path: Any, samples: int = 64) -> str:
    ember.seed_everything(3)
    trainer = quiet_trainer(max_steps=3, logger=False, default_root_dir=str(tmp_path))
    trainer.fit(Regressor(), make_loader(samples, batch_size=8, shuffle=True))
    path = str(tmp_path / "mid-epoch.ckpt")
    trainer.save_checkpoint(path)
    return path


def test_a_dataset_of_another_length_is_refused_unless_the_flag_accepts_it(tmp_path: Any) -> None:
    path = _checkpoint_of_a_run(tmp_path)
    with pytest.raises(ValueError, match=r"dataset length 64 -> 80.*Trainer\(restart_on_data_change=True\)"):
        quiet_trainer(max_epochs=1, logger=False).fit(Regressor(), make_loader(80, batch_size=8), ckpt_path=path)
    trainer = quiet_trainer(max_epochs=1, logger=False, restart_on_data_change=True)
    with pytest.warns(UserWarning, match="the data changed .*epoch 0 starts over"):
        trainer.fit(Regressor(), make_loader(80, batch_size=8), ckpt_path=path)
    assert trainer.global_step == 3 + 10  # the whole epoch of 80 samples, after the 3 steps before


def test_another_seed_is_refused_unless_the_flag_accepts_it(tmp_path: Any) -> None:
    path = _checkpoint_of_a_run(tmp_path)
    ember.seed_everything(4)
    with pytest.raises(ValueError, match=r"global seed 3 -> 4"):
        quiet_trainer(max_epochs=1, logger=False).fit(Regressor(), make_loader(64, batch_size=8), ckpt_path=path)
    ember.seed_everything(3)  # the same seed: no objection
    trainer = quiet_trainer(max_epochs=1, logger=False)
    trainer.fit(Regressor(), make_loader(64, batch_size=8), ckpt_path=path)
    assert trainer.global_step == 8


def test_schedulers_continue_by_step_with_a_warning_when_an_epoch_has_other_steps(tmp_path: Any) -> None:
    class Scheduled(Regressor):
        def configure_optimizers(self) -> Any:
            optimizer = torch.optim.SGD(self.parameters(), lr=0.05)
            return [optimizer], [torch.optim.lr_scheduler.StepLR(optimizer, step_size=1)]

    ember.seed_everything(3)
    first = quiet_trainer(max_steps=3, logger=False)
    first.fit(Scheduled(), make_loader(64, batch_size=8, shuffle=True))
    path = str(tmp_path / "scheduled.ckpt")
    first.save_checkpoint(path)
    trainer = quiet_trainer(max_epochs=1, logger=False)
    with pytest.warns(UserWarning, match="an epoch is now 4 optimizer steps instead of 8"):
        trainer.fit(Scheduled(), make_loader(64, batch_size=16, shuffle=True), ckpt_path=path)
    assert trainer.global_step == 3 + 3  # samples 24..63 in batches of 16: 3 more steps


def test_a_step_scheduler_continues_by_optimizer_step_without_a_warning_when_an_epoch_has_as_many(
    tmp_path: Any, recwarn: pytest.WarningsRecorder
) -> None:
    class Scheduled(Regressor):
        def configure_optimizers(self) -> Any:
            optimizer = torch.optim.SGD(self.parameters(), lr=0.05)
            scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
            return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

    ember.seed_everything(3)
    first = quiet_trainer(max_steps=3, limit_train_batches=4, logger=False)  # 4 steps of 8 samples an epoch
    first.fit(Scheduled(), make_loader(64, batch_size=8, shuffle=True))
    path = str(tmp_path / "scheduled.ckpt")
    first.save_checkpoint(path)
    trainer = quiet_trainer(max_epochs=1, logger=False)  # 4 steps of 16 samples an epoch
    trainer.fit(Scheduled(), make_loader(64, batch_size=16, shuffle=True), ckpt_path=path)
    assert trainer.global_step == 3 + 3
    assert trainer.lr_scheduler_configs[0].scheduler.last_epoch == 6  # one scheduler step per optimizer step
    assert trainer.optimizers[0].param_groups[0]["lr"] == pytest.approx(0.05 * 0.5**6)
    assert not [warning for warning in recwarn if "optimizer steps instead of" in str(warning.message)]


# ------------------------------------------------------------------------------ in one process
class _Indexed(torch.utils.data.Dataset):
    """Sample i is (i, features, target)."""

    def __init__(self, samples: int) -> None:
        self.data = make_data(samples)

    def __getitem__(self, index: int) -> Any:
        return (index, *self.data[index])

    def __len__(self) -> int:
        return len(self.data)


class _IndexedRegressor(Regressor):
    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return super().training_step(batch[1:], batch_idx)

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        super().validation_step(batch[1:], batch_idx)


class _Seen(Callback):
    """Records (epoch, batch_idx, sample indices) of each training batch, and the epochs validated."""

    def __init__(self) -> None:
        self.batches: list[tuple[int, int, list[int]]] = []
        self.validated: list[int] = []

    def on_train_batch_end(self, trainer: ember.Trainer, module: Any, outputs: Any, batch: Any, idx: int) -> None:
        self.batches.append((trainer.current_epoch, idx, batch[0].tolist()))

    def on_validation_epoch_end(self, trainer: ember.Trainer, module: Any) -> None:
        self.validated.append(trainer.current_epoch)


def _fit_indexed(
    samples: int, batch_size: int, seen: _Seen, ckpt_path: str | None = None, seed: int = 3, **flags: Any
) -> Any:
    module = _IndexedRegressor()  # seeds torch itself: the run's seed comes after it, and orders the data
    ember.seed_everything(seed)
    callbacks = [seen, *flags.pop("callbacks", [])]
    trainer = quiet_trainer(logger=False, enable_checkpointing=False, callbacks=callbacks, **flags)
    loader = DataLoader(_Indexed(samples), batch_size=batch_size, shuffle=True)
    trainer.fit(module, loader, DataLoader(_Indexed(8), batch_size=4), ckpt_path=ckpt_path)
    return trainer


class _SaveAndStop(Callback):
    """Saves a checkpoint after the run's ``batches``-th training batch, then stops the run as a kill would."""

    def __init__(self, batches: int, path: str) -> None:
        self.batches, self.path = batches, path

    def on_train_batch_end(self, trainer: ember.Trainer, module: Any, outputs: Any, batch: Any, idx: int) -> None:
        if trainer.fit_loop.progress.total_batches == self.batches:
            trainer.save_checkpoint(self.path)
            raise KeyboardInterrupt


def test_a_checkpoint_inside_an_accumulation_window_resumes_with_another_accumulation(tmp_path: Any) -> None:
    """Saved 2 micro-batches into the second window of 4: with windows of 2 batches of 8, that window runs
    again, as if the checkpoint had been saved when it began."""
    inside, boundary = str(tmp_path / "inside.ckpt"), str(tmp_path / "boundary.ckpt")
    runs = {}
    for path, batches in ((inside, 6), (boundary, 4)):
        first, second = _Seen(), _Seen()
        with pytest.raises(SystemExit):
            _fit_indexed(64, 4, first, max_epochs=2, accumulate_grad_batches=4, callbacks=[_SaveAndStop(batches, path)])
        trainer = _fit_indexed(64, 8, second, path, max_epochs=2, accumulate_grad_batches=2)
        runs[path] = (first.batches[:4], second.batches, parameters_of(trainer.lightning_module))
    assert runs[inside][1] == runs[boundary][1] and runs[inside][1][0][1] == 2  # from sample 16, batch 2 of 8
    assert all(torch.equal(a, b) for a, b in zip(runs[inside][2], runs[boundary][2], strict=True))
    before, after, _ = runs[inside]
    used = collections.Counter(i for epoch, _, indices in before + after if epoch == 0 for i in indices)
    assert used == collections.Counter(range(64))


def test_a_checkpoint_at_the_end_of_an_epoch_starts_the_next_epoch_with_the_new_layout(tmp_path: Any) -> None:
    _fit_indexed(64, 4, _Seen(), max_epochs=1).save_checkpoint(tmp_path / "epoch-end.ckpt")
    resumed, fresh = _Seen(), _Seen()
    _fit_indexed(64, 8, resumed, str(tmp_path / "epoch-end.ckpt"), max_epochs=2)
    _fit_indexed(64, 8, fresh, max_epochs=2)
    assert resumed.batches == [batch for batch in fresh.batches if batch[0] == 1]


def test_a_resumed_epoch_ends_as_an_epoch_of_the_new_batch_size_ends(tmp_path: Any) -> None:
    """20 samples of 50 were read in batches of 4; in batches of 8 the rest is 4 batches, the epoch's last 4 of 7."""
    first = _Seen()
    _fit_indexed(50, 4, first, max_steps=5).save_checkpoint(tmp_path / "mid-epoch.ckpt")
    second = _Seen()
    _fit_indexed(50, 8, second, str(tmp_path / "mid-epoch.ckpt"), max_epochs=2)
    resumed = [(idx, indices) for epoch, idx, indices in second.batches if epoch == 0]
    assert [idx for idx, _ in resumed] == [3, 4, 5, 6]  # numbered as the epoch's last batches
    used = collections.Counter(i for _, _, indices in first.batches for i in indices)
    used.update(i for _, indices in resumed for i in indices)
    assert used == collections.Counter(range(50))
    assert second.validated == [0, 1]  # the resumed epoch's end is validated too


def test_an_accepted_new_seed_orders_the_restarted_epoch_as_a_run_with_that_seed(tmp_path: Any) -> None:
    first, resumed, fresh = _Seen(), _Seen(), _Seen()
    _fit_indexed(64, 8, first, max_steps=3).save_checkpoint(tmp_path / "seed-3.ckpt")
    with pytest.warns(UserWarning, match=r"the data changed \(global seed 3 -> 4\): epoch 0 starts over"):
        trainer = _fit_indexed(64, 8, resumed, str(tmp_path / "seed-3.ckpt"), seed=4, max_epochs=2,
                               restart_on_data_change=True)  # fmt: skip
    _fit_indexed(64, 8, fresh, seed=4, max_epochs=2)
    assert trainer.global_step == 3 + 16
    assert resumed.batches == fresh.batches  # epoch 0 from its start, then epoch 1, in seed 4's order
    assert resumed.batches[0] != first.batches[0]  # not in seed 3's


def test_a_stateful_loader_resumed_with_another_batch_size_starts_the_epoch_over(tmp_path: Any) -> None:
    stateful = pytest.importorskip("torchdata.stateful_dataloader")

    def fit(batch_size: int, seen: _Seen, ckpt_path: str | None = None, **flags: Any) -> Any:
        module = _IndexedRegressor()
        ember.seed_everything(3)
        trainer = quiet_trainer(logger=False, enable_checkpointing=False, callbacks=[seen], **flags)
        loader = stateful.StatefulDataLoader(_Indexed(64), batch_size=batch_size, shuffle=True)
        trainer.fit(module, loader, ckpt_path=ckpt_path)
        return trainer

    fit(8, _Seen(), max_steps=3).save_checkpoint(tmp_path / "stateful.ckpt")
    resumed = _Seen()
    with pytest.warns(UserWarning, match="batch size 8 -> 16: the train dataloader cannot continue at a sample"):
        fit(16, resumed, str(tmp_path / "stateful.ckpt"), max_epochs=1)
    # As the warning says: the whole epoch, not the rest of it from the loader's saved position.
    assert sorted(index for _, _, indices in resumed.batches for index in indices) == list(range(64))


def test_the_position_counts_samples_however_a_batch_is_laid_out(tmp_path: Any) -> None:
    """A collate function that puts a sequence-first tensor first (time, batch, features): the position in
    the epoch is counted in samples of the order, not in the first dimension of the batch's first tensor."""

    def sequence_first(samples: list[Any]) -> Any:
        indices, x, y = default_collate(samples)
        return x.unsqueeze(0).expand(5, -1, -1), indices, y  # 5 time steps, then the batch

    class SequenceFirst(_IndexedRegressor):
        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            x, indices, y = batch
            return super().training_step((indices, x[-1], y), batch_idx)

    class Seen(_Seen):
        def on_train_batch_end(self, trainer: ember.Trainer, module: Any, outputs: Any, batch: Any, idx: int) -> None:
            self.batches.append((trainer.current_epoch, idx, batch[1].tolist()))

    def fit(batch_size: int, seen: _Seen, ckpt_path: str | None = None, **flags: Any) -> Any:
        module = SequenceFirst()
        ember.seed_everything(3)
        trainer = quiet_trainer(logger=False, enable_checkpointing=False, callbacks=[seen], **flags)
        loader = DataLoader(_Indexed(64), batch_size=batch_size, shuffle=True, collate_fn=sequence_first)
        trainer.fit(module, loader, ckpt_path=ckpt_path)
        return trainer

    first, second = Seen(), Seen()
    fit(4, first, max_steps=3).save_checkpoint(tmp_path / "sequence-first.ckpt")
    fit(8, second, str(tmp_path / "sequence-first.ckpt"), max_epochs=1)
    used = collections.Counter(i for _, _, indices in first.batches + second.batches for i in indices)
    assert used == collections.Counter(range(64))
