"""Runs that never lose or mix work: run directories, what "last" means, checkpoint integrity, disks, and
weights that went non-finite."""

from __future__ import annotations

import json
import multiprocessing
import os
import pickle
import random
import re
import signal
import subprocess
import sys
import textwrap
import threading
import zipfile
from typing import Any

import pytest
import torch
import warm_processes
from conftest import Regressor, make_loader, quiet_trainer

import ember
from ember import checkpoint as checkpoint_io
from ember.callbacks import Callback, ModelCheckpoint, OnExceptionCheckpoint
from ember.checkpoint import state as checkpoint_state
from ember.loggers.csv_logger import CSVLogger
from ember.loggers.logger import claim_version

# ------------------------------------------------------------------------------------ run directories
_RUN = textwrap.dedent(
    """
    import sys
    import torch
    from torch.utils.data import DataLoader, TensorDataset
    sys.path.insert(0, {tests!r})
    from conftest import Regressor
    import ember

    marker = float(sys.argv[1])
    x = torch.randn(64, 4)
    loader = DataLoader(TensorDataset(x, x.sum(1, keepdim=True)), batch_size=8)
    trainer = ember.Trainer(accelerator="cpu", max_epochs=2, default_root_dir={root!r}, log_every_n_steps=2,
                            enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(Regressor(lr=marker), loader, loader)
    print(trainer.log_dir)
    """
)


@pytest.mark.timeout(120)
def test_two_runs_started_together_in_one_folder_never_share_a_directory(tmp_path: Any) -> None:
    root = str(tmp_path / "shared")
    script = tmp_path / "run.py"
    script.write_text(_RUN.format(tests=os.path.dirname(__file__), root=root))
    runs = [
        warm_processes.Popen([sys.executable, str(script), lr], stdout=subprocess.PIPE, text=True)
        for lr in ("0.01", "0.02")
    ]
    log_dirs = []
    for run in runs:
        stdout, _ = run.communicate(timeout=100)
        assert run.returncode == 0
        log_dirs.append(stdout.strip().splitlines()[-1])
    assert sorted(os.path.basename(path) for path in log_dirs) == ["version_0", "version_1"]
    hyperparameters = []
    for log_dir in log_dirs:
        hyperparameters.append(_read(os.path.join(log_dir, "hparams.yaml")))
        rows = _read(os.path.join(log_dir, "metrics.csv")).splitlines()
        assert len(rows) == 1 + 8 + 2  # the header, a row every 2 of 16 steps, and each epoch's validation
        assert len(os.listdir(os.path.join(log_dir, "checkpoints"))) == 1
    assert hyperparameters[0] != hyperparameters[1]  # each run wrote its own


def _read(path: str) -> str:
    with open(path) as file:
        return file.read()


def test_claiming_versions_at_the_same_time_gives_each_claimant_its_own(tmp_path: Any) -> None:
    root = str(tmp_path / "runs")
    claimed: list[int] = []
    start = threading.Barrier(8)

    def claim() -> None:
        start.wait()
        claimed.append(claim_version(root))

    threads = [threading.Thread(target=claim) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert sorted(claimed) == list(range(8)) and sorted(os.listdir(root)) == [f"version_{n}" for n in range(8)]


class _Scored(Regressor):
    def validation_step(self, batch: Any, batch_idx: int) -> None:
        self.log("score", float(self.current_epoch))


def _best_and_last() -> ModelCheckpoint:
    return ModelCheckpoint(monitor="score", mode="max", save_top_k=1, save_last=True)


def _snapshot(directory: str) -> dict[str, float]:
    return {name: os.path.getmtime(os.path.join(directory, name)) for name in os.listdir(directory)}


def test_a_run_started_from_another_runs_checkpoint_writes_only_into_its_own_directory(tmp_path: Any) -> None:
    root = str(tmp_path)
    first = quiet_trainer(max_epochs=3, default_root_dir=root, callbacks=[_best_and_last()])
    first.fit(_Scored(), make_loader(16), make_loader(8))
    first_dir = first.checkpoint_dir
    before = _snapshot(first_dir)
    second = quiet_trainer(max_epochs=6, default_root_dir=root, callbacks=[_best_and_last()])
    with pytest.warns(UserWarning, match="dirpath has changed"):  # only best_model_path is taken over
        second.fit(_Scored(), make_loader(16), make_loader(8), ckpt_path=os.path.join(first_dir, "epoch=2-step=6.ckpt"))
    assert second.global_step == 12 and second.log_dir != first.log_dir
    assert _snapshot(first_dir) == before  # nothing replaced, nothing pruned
    assert sorted(os.listdir(second.checkpoint_dir)) == ["epoch=5-step=12.ckpt", "last.ckpt"]


def test_a_run_resumed_with_last_continues_its_lineage_in_place(tmp_path: Any) -> None:
    root = str(tmp_path)
    first = quiet_trainer(max_epochs=2, default_root_dir=root, callbacks=[_best_and_last()])
    first.fit(_Scored(), make_loader(16), make_loader(8))
    second = quiet_trainer(max_epochs=4, default_root_dir=root, callbacks=[_best_and_last()])
    second.fit(_Scored(), make_loader(16), make_loader(8), ckpt_path="last")
    assert second.log_dir == first.log_dir
    # The lineage's top-1 moved on: its earlier best file is gone, as in one long run.
    assert sorted(os.listdir(second.checkpoint_dir)) == ["epoch=3-step=8.ckpt", "last.ckpt"]
    assert sorted(os.listdir(os.path.join(root, "ember_logs"))) == ["version_0"]


class _ReadsTheRunDirectory(Callback):
    """Reads ``trainer.log_dir`` in ``setup``, as callbacks that write files beside the logs do."""

    seen: str | None = None

    def setup(self, trainer: ember.Trainer, module: Any, stage: str) -> None:
        self.seen = trainer.log_dir


def test_hooks_that_read_the_run_directory_early_see_the_run_continued_with_last(tmp_path: Any) -> None:
    root = str(tmp_path)
    first = quiet_trainer(max_epochs=1, default_root_dir=root)
    first.fit(Regressor(), make_loader(16))
    reader = _ReadsTheRunDirectory()
    second = quiet_trainer(max_epochs=2, default_root_dir=root, callbacks=[reader])
    second.fit(Regressor(), make_loader(16), ckpt_path="last")
    assert reader.seen == second.log_dir == first.log_dir
    assert sorted(os.listdir(os.path.join(root, "ember_logs"))) == ["version_0"]


class _Preempt(Callback):
    """Sends SIGTERM to this process at global step ``at``, as a scheduler does."""

    def __init__(self, at: int) -> None:
        self.at = at

    def on_train_batch_end(self, trainer: ember.Trainer, module: Any, outputs: Any, batch: Any, idx: int) -> None:
        if trainer.global_step == self.at:
            os.kill(os.getpid(), signal.SIGTERM)


def test_a_run_that_keeps_no_files_saves_its_preemption_checkpoint_where_last_finds_it(
    tmp_path: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    flags: dict[str, Any] = dict(default_root_dir=str(tmp_path), logger=False, enable_checkpointing=False)
    trainer = quiet_trainer(max_epochs=3, callbacks=[_Preempt(at=3)], **flags)
    with pytest.raises(SystemExit):
        trainer.fit(Regressor(), make_loader(16))
    printed = capsys.readouterr().out
    resumed = quiet_trainer(max_epochs=3, **flags)
    found = checkpoint_state.find_checkpoint(resumed, "last")
    report = printed.strip().splitlines()[-3:]
    assert found is not None and report[0].endswith("at global step 3; saved")
    assert os.path.abspath(report[1].strip()) == found and all(len(line) <= 80 for line in report[::2])
    # The README shows this very report, but for the path and the step.
    with open(os.path.join(os.path.dirname(__file__), "..", "README.md")) as file:
        lines = file.read().splitlines()
    start = next(index for index, line in enumerate(lines) if line.startswith("stopped by SIGTERM"))
    assert _in_general(lines[start : start + 3]) == _in_general(report)
    resumed.fit(Regressor(), make_loader(16), ckpt_path="last")
    assert resumed.global_step == 6 and "resuming from" in capsys.readouterr().out


def _in_general(lines: list[str]) -> list[str]:
    return [re.sub(r"global step \d+", "global step N", line) for line in (lines[0], lines[2])]


# --------------------------------------------------------------------------------------- "last"
def test_last_ignores_files_outside_the_lineage_and_skips_a_damaged_newest_one(tmp_path: Any) -> None:
    root = str(tmp_path)
    run = quiet_trainer(max_epochs=3, default_root_dir=root, callbacks=[ModelCheckpoint(save_top_k=-1)])
    run.fit(Regressor(), make_loader(16))
    directory = run.checkpoint_dir
    # Newer files that are not this lineage's: a pretrained model and a backup copy beside the runs.
    torch.save({"state_dict": Regressor().state_dict()}, os.path.join(root, "pretrained.ckpt"))
    checkpoint_io.save(
        checkpoint_io.load(os.path.join(directory, "epoch=0-step=2.ckpt")), os.path.join(root, "backup.ckpt")
    )
    fresh = quiet_trainer(default_root_dir=root)
    assert checkpoint_state.find_checkpoint(fresh, "last") == os.path.join(directory, "epoch=2-step=6.ckpt")
    newest = os.path.join(directory, "epoch=2-step=6.ckpt")
    with open(newest, "r+b") as file:
        file.truncate(os.path.getsize(newest) // 2)  # cut short, as a copy or a crashed disk leaves it
    with pytest.warns(UserWarning, match=r"passing over .*epoch=2-step=6\.ckpt.*truncated or damaged|passing over"):
        found = checkpoint_state.find_checkpoint(fresh, "last")
    assert found == os.path.join(directory, "epoch=1-step=4.ckpt")
    resumed = quiet_trainer(max_epochs=3, default_root_dir=root)
    with pytest.warns(UserWarning, match="passing over"):
        resumed.fit(Regressor(), make_loader(16), ckpt_path="last")
    assert resumed.global_step == 6  # epoch 2 run again from the end of epoch 1


@pytest.mark.parametrize("periodic_dirpath", ["given", "the run's"])
def test_last_is_the_newest_checkpoint_of_all_the_lineages_directories(periodic_dirpath: str, tmp_path: Any) -> None:
    """A ModelCheckpoint that keeps the best file (from epoch 0 here) beside one that saves every epoch: a
    crashed run continues from the newest file, wherever it is."""
    root = str(tmp_path)

    def callbacks() -> list[Callback]:
        best = ModelCheckpoint(dirpath=os.path.join(root, "best"), monitor="score", mode="min", save_top_k=1)
        periodic = os.path.join(root, "periodic") if periodic_dirpath == "given" else None
        return [best, ModelCheckpoint(dirpath=periodic, save_top_k=-1)]

    first = quiet_trainer(max_epochs=3, default_root_dir=root, callbacks=callbacks())
    first.fit(_Scored(), make_loader(16), make_loader(8))
    newest = os.path.join(first.checkpoint_callbacks[1].dirpath or "", "epoch=2-step=6.ckpt")
    again = quiet_trainer(default_root_dir=root, callbacks=callbacks())
    assert checkpoint_state.find_checkpoint(again, "last") == newest


def test_last_without_a_complete_checkpoint_warns_and_starts_fresh(tmp_path: Any) -> None:
    root = str(tmp_path)
    version = tmp_path / "ember_logs" / "version_0" / "checkpoints"
    version.mkdir(parents=True)
    (version / "last.ckpt").write_bytes(b"")  # a save that never finished
    trainer = quiet_trainer(max_epochs=1, default_root_dir=root, log_every_n_steps=1)  # no warning of a long interval
    with pytest.warns(UserWarning) as caught:
        trainer.fit(Regressor(), make_loader(16), ckpt_path="last")
    # (Regressor's validation_step without a validation loader is warned about too, as in Lightning.) That nothing
    # is left to resume is said in an INFO line (test_resume.py), not warned of.
    skipped = "You defined a `validation_step` but have no `val_dataloader`"
    [passed_over] = [str(warning.message) for warning in caught if skipped not in str(warning.message)]
    assert "last.ckpt" in passed_over and "is empty" in passed_over
    assert {warning.filename for warning in caught} == {__file__}  # they point at the fit call
    assert trainer.global_step == 2


# ------------------------------------------------------------------------------------ integrity
def _good_checkpoint(tmp_path: Any) -> str:
    trainer = quiet_trainer(max_epochs=1, default_root_dir=str(tmp_path / "good"), logger=False)
    trainer.fit(Regressor(), make_loader(16))
    assert trainer.checkpoint_callback is not None
    return trainer.checkpoint_callback.best_model_path


def _make_bad(kind: str, tmp_path: Any) -> str:
    path = str(tmp_path / f"{kind}.ckpt")
    good = _good_checkpoint(tmp_path)
    content = (tmp_path / good).read_bytes()
    written = {
        "empty": b"",
        "truncated": content[: len(content) // 3],
        "flipped": content[:300] + bytes([content[300] ^ 1]) + content[301:],
        "random": random.Random(0).randbytes(4096),
        "json": json.dumps({"state_dict": {}, "epoch": 1}).encode(),
        "text": b"epoch: 3\nweights: see the other file\n",
        "random_from_0x80": b"\x80" + random.Random(1).randbytes(4095),  # the first byte a pickle's
        "pickle": pickle.dumps({"epoch": 3, "weights": [0.5, 0.25]}),
    }
    if kind in written:
        (tmp_path / path).write_bytes(written[kind])
    elif kind == "zip":
        with zipfile.ZipFile(path, "w") as archive:
            archive.writestr("notes/readme.txt", "not a checkpoint")
    elif kind == "bare_state_dict":
        torch.save(Regressor().state_dict(), path)
    elif kind == "directory":
        os.makedirs(path)
        (tmp_path / path / "notes.txt").write_text("not a sharded checkpoint")
    elif kind == "dangling":
        os.symlink(str(tmp_path / "gone.ckpt"), path)
    elif kind == "other_model":
        state = checkpoint_io.load(good)
        state["state_dict"] = torch.nn.Linear(7, 3).state_dict()
        checkpoint_io.save(state, path)
    return path


@pytest.mark.parametrize(
    ("kind", "message"),
    [
        ("empty", "is empty"),
        ("truncated", "is not a readable checkpoint: it is truncated or damaged"),
        ("flipped", "is damaged: its content no longer matches the digest"),
        ("random", "is not a checkpoint: it does not start like a file written by torch.save"),
        ("json", "holds JSON"),
        ("text", "is a text file, not a checkpoint"),
        ("directory", "is a directory but not a complete sharded checkpoint"),
        ("dangling", "is a link to .*gone.ckpt.*, which does not exist"),
        ("other_model", "holds the weights of another model than this Regressor"),
        ("random_from_0x80", "is not a checkpoint: it does not start like a file written by torch.save"),
        ("pickle", "is not a checkpoint: it does not start like a file written by torch.save"),
        ("zip", "is a zip archive, but not a checkpoint written by torch.save"),
        ("bare_state_dict", r"holds only a state_dict .*load_state_dict\(torch\.load"),
    ],
)
def test_every_way_a_file_can_fail_to_be_a_checkpoint_gives_one_error_naming_it(
    kind: str, message: str, tmp_path: Any
) -> None:
    path = _make_bad(kind, tmp_path)
    for attempt in (
        lambda: quiet_trainer(max_epochs=1, logger=False).fit(Regressor(), make_loader(16), ckpt_path=path),
        lambda: quiet_trainer(logger=False).validate(Regressor(), make_loader(16), ckpt_path=path, verbose=False),
        lambda: Regressor.load_from_checkpoint(path),
    ):
        with pytest.raises(checkpoint_io.CheckpointError, match=message) as raised:
            attempt()
        assert repr(path) in str(raised.value) or path in str(raised.value)


def test_every_checkpoint_carries_what_verifies_it(tmp_path: Any) -> None:
    path = _good_checkpoint(tmp_path)
    assert checkpoint_io.verify(path) is True  # a digest was there and matched
    plain = str(tmp_path / "plain.ckpt")
    torch.save({"state_dict": {}}, plain)
    assert checkpoint_io.verify(plain) is False  # torch.save's own file: plausible, not verified


# ---------------------------------------------------------------------------------------- disks
def test_an_unwritable_run_directory_fails_before_the_first_step(tmp_path: Any) -> None:
    (tmp_path / "a-file").write_text("not a directory")
    steps: list[int] = []

    class Count(Callback):
        def on_train_batch_start(self, trainer: ember.Trainer, module: Any, batch: Any, batch_idx: int) -> None:
            steps.append(batch_idx)

    root = str(tmp_path / "a-file" / "runs")
    with pytest.raises(NotADirectoryError, match=r"cannot (create a run directory under|write to) .*a-file"):
        quiet_trainer(max_epochs=1, default_root_dir=root, callbacks=[Count()]).fit(Regressor(), make_loader(16))
    assert steps == []
    unwritable_checkpoints = ModelCheckpoint(dirpath=str(tmp_path / "a-file" / "checkpoints"))
    with pytest.raises(OSError, match=r"cannot write to .*a-file.*checkpoints"):
        quiet_trainer(max_epochs=1, callbacks=[unwritable_checkpoints, Count()], logger=False).fit(
            Regressor(), make_loader(16)
        )
    assert steps == []


_READ_ONLY = textwrap.dedent(
    """
    import sys
    sys.path.insert(0, {tests!r})
    from conftest import Regressor, make_loader, quiet_trainer
    from ember.callbacks import Callback

    class Count(Callback):
        def on_train_batch_start(self, trainer, module, batch, batch_idx):
            raise AssertionError("a step began")

    for flags in (dict(), dict(logger=False)):
        try:
            quiet_trainer(max_epochs=1, default_root_dir=sys.argv[1], callbacks=[Count()], **flags).fit(
                Regressor(), make_loader(16)
            )
        except OSError as error:
            print(type(error).__name__, error)
    """
)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="mounts a read-only file system")
def test_a_read_only_default_root_dir_fails_before_the_first_step(tmp_path: Any) -> None:
    """A read-only file system mounted in a user namespace (where this test's user is root, whom a mere
    chmod would not stop)."""
    script, mount = tmp_path / "read_only.py", tmp_path / "read-only"
    script.write_text(_READ_ONLY.format(tests=os.path.dirname(__file__)))
    mount.mkdir()
    command = f"mount -t tmpfs -o ro tmpfs {mount} && exec {sys.executable} {script} {mount}"
    try:
        result = warm_processes.run(
            ["unshare", "--user", "--map-root-user", "--mount", "sh", "-c", command],
            capture_output=True, text=True, timeout=60,
        )  # fmt: skip
    except FileNotFoundError:
        pytest.skip("no unshare command")
    if "mount" in result.stderr or "unshare" in result.stderr:
        pytest.skip(f"cannot mount a read-only file system here: {result.stderr.strip()}")
    lines = result.stdout.strip().splitlines()
    assert result.returncode == 0 and len(lines) == 2, result.stdout + result.stderr[-2000:]
    with_logger, without = lines  # the second with only the default ModelCheckpoint, into <root>/checkpoints
    assert f"cannot create a run directory under '{mount}" in with_logger and "Read-only file system" in with_logger
    assert f"cannot write to '{mount}/checkpoints'" in without and "Read-only file system" in without


def _with_file_size_limit(limit: int, work: str, *args: str) -> tuple[str, str]:
    """Run ``work(*args)`` (a function of this file) in a process that may write files of ``limit`` bytes at
    most (a full disk, as far as the writer can tell); returns ("ok", "") or (exception type, message)."""
    code = textwrap.dedent(
        f"""
        import json, resource, signal, sys
        sys.path[:0] = [{os.path.dirname(__file__)!r}]
        import test_runs
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # writes past the limit then fail with EFBIG
        resource.setrlimit(resource.RLIMIT_FSIZE, ({limit}, {limit}))
        try:
            test_runs.{work}(*{list(args)!r})
            print(json.dumps(["ok", ""]))
        except BaseException as error:
            print(json.dumps([type(error).__name__, str(error)]))
        """
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    kind, message = json.loads(result.stdout.strip().splitlines()[-1])
    return kind, message


def _save_big(path: str) -> None:
    checkpoint_io.save({"weights": torch.zeros(200_000)}, path)


def test_a_full_disk_during_a_save_names_the_file_and_keeps_the_previous_one(tmp_path: Any) -> None:
    path = str(tmp_path / "run.ckpt")
    checkpoint_io.save({"weights": torch.ones(10)}, path)
    kind, message = _with_file_size_limit(100_000, "_save_big", path)
    assert kind == "CheckpointError", message
    assert repr(path) in message and "disk is full" in message and "previous file is intact" in message
    assert torch.equal(checkpoint_io.load(path)["weights"], torch.ones(10))
    assert os.listdir(tmp_path) == ["run.ckpt"]  # no temporary left behind


class _Ballast(Regressor):
    """A Regressor whose checkpoints take about 400 kB."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("ballast", torch.zeros(100_000))


def _train_on(root: str, epochs: str) -> None:
    last_too = ModelCheckpoint(save_last=True)
    trainer = quiet_trainer(max_epochs=int(epochs), default_root_dir=root, logger=False, callbacks=[last_too])
    trainer.fit(_Ballast(), make_loader(16), ckpt_path="last")


def test_a_run_whose_disk_fills_up_keeps_its_previous_checkpoint_and_last(tmp_path: Any) -> None:
    root = str(tmp_path)
    _train_on(root, "1")
    directory = os.path.join(root, "checkpoints")  # no logger: <default_root_dir>/checkpoints, as Lightning
    kind, message = _with_file_size_limit(200_000, "_train_on", root, "3")  # a checkpoint no longer fits
    assert kind == "CheckpointError", message
    assert repr(os.path.join(directory, "epoch=1-step=4.ckpt")) in message and "File too large" in message
    assert sorted(os.listdir(directory)) == ["epoch=0-step=2.ckpt", "last.ckpt"]  # no temporary left behind
    last = checkpoint_state.find_checkpoint(quiet_trainer(default_root_dir=root, logger=False), "last")
    assert last is not None and checkpoint_io.load(last)["global_step"] == 2
    assert checkpoint_io.load(os.path.join(directory, "last.ckpt"))["global_step"] == 2


def _log_until_full(directory: str) -> None:
    logger = CSVLogger(directory, version=0, flush_logs_every_n_steps=1)
    for step in range(100_000):
        logger.log_metrics({"loss": 1.0 / (step + 1), "epoch": 0}, step)
    logger.save()


def test_metrics_csv_is_appended_and_a_full_disk_keeps_its_history_whole(tmp_path: Any) -> None:
    kind, message = _with_file_size_limit(30_000, "_log_until_full", str(tmp_path))
    assert kind == "OSError", message
    path = tmp_path / "ember_logs" / "version_0" / "metrics.csv"
    lines = path.read_text().splitlines()
    assert lines[0] == "epoch,loss,step" and len(lines) > 100
    steps = [int(line.split(",")[-1]) for line in lines[1:]]
    assert steps == list(range(len(steps)))  # every row whole, none lost before the disk filled up
    assert path.read_text().endswith("\n")


def test_a_stale_partial_save_is_removed_at_the_next_start(tmp_path: Any) -> None:
    directory = tmp_path / "checkpoints"
    (directory / ".epoch=1-step=4.ckpt.partial").mkdir(parents=True)  # a sharded save that was cut short
    (directory / ".epoch=1-step=4.ckpt.partial" / "__0_0.distcp").write_bytes(b"x")
    (directory / ".last.ckpt.999999.0a1b2c3d.tmp").write_bytes(b"x")  # its writer is gone
    trainer = quiet_trainer(max_epochs=1, logger=False, callbacks=[ModelCheckpoint(dirpath=str(directory))])
    trainer.fit(Regressor(), make_loader(16))
    assert sorted(os.listdir(directory)) == ["epoch=0-step=2.ckpt"]


# ----------------------------------------------------------------------------- non-finite weights
class _Diverging(Regressor):
    """Its loss turns NaN at global step 5, after which its weights do too."""

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = super().training_step(batch, batch_idx)
        return loss * float("nan") if self.global_step >= 5 else loss


def test_non_finite_weights_are_never_saved_where_last_finds_them(tmp_path: Any) -> None:
    root = str(tmp_path)
    on_exception = OnExceptionCheckpoint(os.path.join(root, "crash"))
    every_two_steps = ModelCheckpoint(every_n_train_steps=2, save_top_k=-1)
    trainer = quiet_trainer(max_epochs=10, default_root_dir=root, callbacks=[every_two_steps, on_exception])
    with pytest.raises(FloatingPointError):
        trainer.fit(_Diverging(), make_loader(16))
    failure = os.path.join(root, "crash", "on_exception.nonfinite.ckpt")
    saved = checkpoint_io.load(failure)
    assert "nonfinite_parameters" in saved["failure"]  # kept for a post-mortem, and marked
    last = checkpoint_state.find_checkpoint(quiet_trainer(default_root_dir=root), "last")
    assert last is not None and last.endswith("epoch=1-step=4.ckpt")  # before the loss (step 5) diverged
    state = checkpoint_io.load(last)["state_dict"]
    assert all(torch.isfinite(tensor).all() for tensor in state.values())


def test_a_save_of_non_finite_weights_is_refused_and_keeps_the_previous_file(tmp_path: Any) -> None:
    path = str(tmp_path / "model.ckpt")
    trainer = quiet_trainer(max_epochs=1, logger=False, enable_checkpointing=False)
    module = Regressor()
    trainer.fit(module, make_loader(16))
    trainer.save_checkpoint(path)
    with torch.no_grad():
        module.layer.weight[0, 0] = float("inf")
    with pytest.raises(FloatingPointError, match=r"NaN or infinite values .*layer\.weight.*was not saved"):
        trainer.save_checkpoint(path)
    assert torch.isfinite(checkpoint_io.load(path)["state_dict"]["layer.weight"]).all()


_PERSISTENT = textwrap.dedent(
    """
    import os, signal, sys
    from torch.utils.data import DataLoader
    sys.path.insert(0, {tests!r})
    from conftest import Regressor, make_data
    import ember
    from ember.callbacks import Callback

    class Preempt(Callback):
        def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
            if trainer.global_step == 3:
                os.kill(os.getpid(), signal.SIGTERM)

    loader = DataLoader(make_data(64), batch_size=4, num_workers=2, persistent_workers=True)
    trainer = ember.Trainer(accelerator="cpu", max_epochs=2, default_root_dir={root!r}, callbacks=[Preempt()],
                            enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(Regressor(), loader)
    """
)


@pytest.mark.timeout(90)
def test_a_preempted_run_with_persistent_loader_workers_saves_and_exits(tmp_path: Any) -> None:
    script = tmp_path / "persistent.py"
    script.write_text(_PERSISTENT.format(tests=os.path.dirname(__file__), root=str(tmp_path)))
    result = warm_processes.run([sys.executable, str(script)], capture_output=True, text=True, timeout=60)
    assert result.returncode == 128 + signal.SIGTERM, result.stderr[-2000:]
    assert "stopped by SIGTERM at global step" in result.stdout


class _SignalTheLoaderWorkers(Callback):
    """At global step 2, sends SIGTERM twice to each loader worker from another process, as SLURM's scancel
    and then torchrun's agent, passing it on, do."""

    def on_train_batch_end(self, trainer: ember.Trainer, module: Any, outputs: Any, batch: Any, idx: int) -> None:
        if trainer.global_step != 2:
            return
        workers = [str(process.pid) for process in multiprocessing.active_children()]
        assert len(workers) == 2
        send = "import os, signal, sys; [os.kill(int(pid), signal.SIGTERM) for pid in sys.argv[1:]]"
        for _ in range(2):
            subprocess.run([sys.executable, "-c", send, *workers], check=True, timeout=30)


@pytest.mark.parametrize("threads_used_before", [0, 2], ids=["threads as set", "more threads used before"])
def test_loader_workers_outlive_signals_that_are_not_from_their_main_process(threads_used_before: int) -> None:
    if threads_used_before:  # the OpenMP runtime then starts its threads again in each forked worker, at once
        threads = torch.get_num_threads()
        torch.set_num_threads(threads + threads_used_before)
        torch.mm(torch.randn(256, 256), torch.randn(256, 256))
        torch.set_num_threads(threads)
    signals = _SignalTheLoaderWorkers()
    trainer = quiet_trainer(max_epochs=2, logger=False, enable_checkpointing=False, callbacks=[signals])
    trainer.fit(Regressor(), make_loader(64, num_workers=2))
    assert trainer.global_step == 16  # every batch was still read
    assert multiprocessing.active_children() == []  # and the workers ended with the epoch


_HOLDS_AN_ITERATOR = textwrap.dedent(
    """
    import sys
    sys.path.insert(0, {tests!r})
    from conftest import Regressor, make_loader, quiet_trainer
    from ember.callbacks import Callback

    held = []

    class Peek(Callback):
        def on_train_start(self, trainer, module):
            batches = iter(trainer.train_dataloader)  # as a callback that shows a sample batch does
            next(batches)
            held.append(batches)

    trainer = quiet_trainer(max_epochs=1, logger=False, enable_checkpointing=False, callbacks=[Peek()])
    trainer.fit(Regressor(), make_loader(32, num_workers=2))
    print("trained")
    """
)


@pytest.mark.timeout(90)
def test_a_process_that_still_holds_a_loader_iterator_exits(tmp_path: Any) -> None:
    """At exit, multiprocessing ends the iterator's workers with SIGTERM from the main process: they must obey."""
    script = tmp_path / "holds.py"
    script.write_text(_HOLDS_AN_ITERATOR.format(tests=os.path.dirname(__file__)))
    result = warm_processes.run([sys.executable, str(script)], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0 and "trained" in result.stdout, result.stderr[-2000:]
