"""What a user is told: bad command lines are one line and status 2, warnings come once from rank zero,
a machine without the hardware asked for says what to pass instead."""

from __future__ import annotations

import os
import sys
import warnings
from typing import Any

import pytest
import torch
import warm_processes
from conftest import Regressor, make_loader, quiet_trainer

import ember
from ember.cli import main
from ember.precision import build_precision
from ember.rank_zero import rank_zero_only, rank_zero_warn_once

# ----------------------------------------------------------------------------- the command line
_BAD_COMMAND_LINES = [
    (["run", "-m", "nope_module"], "ember run: -m 'nope_module': no module 'nope_module' here or among"),
    (["doctor", "-m", "nope_module.train"], "ember doctor: -m 'nope_module.train': no module 'nope_module'"),
    (["doctor", "--nproc-per-node", "0", "train.py"], "ember doctor: --nproc-per-node='0': give a positive count"),
    (["doctor", "--steps", "many", "train.py"], "ember doctor: argument --steps: invalid int value: 'many'"),
    (["run"], "ember run: the following arguments are required: SCRIPT (see ember run --help)\n"),
    (["run", "--max-restarts", "-1", "train.py"], "ember run: --max-restarts=-1: give 0 or more restarts"),
    (["run", "--nnodes", "2", "--node-rank", "2", "--rdzv-endpoint", "127.0.0.1:29400", "train.py"],
     "ember run: --node-rank=2: give 0 to 1, one per machine of --nnodes=2"),
    (["run", "--nnodes", "2", "--rdzv-endpoint", "nohost", "train.py"],
     "ember run: --rdzv-endpoint='nohost': expected HOST:PORT, such as 10.0.0.1:29400"),
    (["run", "--nnodes", "2", "--rdzv-endpoint", "host:99999", "train.py"],
     "ember run: --rdzv-endpoint='host:99999': expected HOST:PORT"),
    (["run", "--nnodes", "2", "--rdzv-endpoint", "no-such-host.invalid:29400", "train.py"],
     "ember run: --rdzv-endpoint='no-such-host.invalid:29400': no host 'no-such-host.invalid' is known"),
    (["run", "-m", ".relative"], "ember run: -m '.relative': not a module name (such as mypackage.train)"),
    (["doctor"], "ember doctor: the following arguments are required: SCRIPT (see ember doctor --help)\n"),
    (["plot", "--x", "time", "runs"], "ember plot: argument --x: invalid choice: 'time'"),
    (["plot", "-o", "train.py/curves.png", "runs"], "ember plot: --output 'train.py/curves.png' cannot be written"),
    (["plot", "-o", ".", "runs"], "ember plot: --output '.' is a directory: give the name of the file to write"),
    (["checkpoint"], "ember checkpoint: the following arguments are required: ACTION"),
    (["checkpoint", "consolidate", "nope", "out.ckpt"], "ember checkpoint consolidate: DIR 'nope': no such directory"),
    (["checkpoint", "consolidate", "train.py", "out.ckpt"],
     "ember checkpoint consolidate: DIR 'train.py' is not a sharded checkpoint"),
    (["checkpoint", "consolidate", "sharded", "."], "ember checkpoint consolidate: OUT '.' is a directory"),
    (["checkpoint", "consolidate", "sharded", "train.py/out.ckpt"],
     "ember checkpoint consolidate: OUT 'train.py/out.ckpt' cannot be written"),
    (["train"], "ember: argument COMMAND: invalid choice: 'train'"),
]  # fmt: skip


def _workspace(directory: Any) -> None:
    (directory / "train.py").write_text("raise SystemExit('the script must not run')\n")
    (directory / "sharded").mkdir()


@pytest.mark.parametrize(
    ("arguments", "message"),
    [
        (["run", "nope.py"], "ember run: SCRIPT 'nope.py': no such file (give a Python script, or -m"),
        (["doctor", "nope.py", "--lr", "1"], "ember doctor: SCRIPT 'nope.py': no such file"),
        (["run", "--nproc-per-node", "2", "--bogus", "train.py"],
         "ember run: unrecognized arguments: --bogus (see ember run --help)"),
        _BAD_COMMAND_LINES[-1],
    ],
)  # fmt: skip
def test_a_bad_command_line_is_one_line_and_status_2(arguments: list[str], message: str, tmp_path: Any) -> None:
    _workspace(tmp_path)
    result = warm_processes.run(
        [sys.executable, "-m", "ember", *arguments], cwd=tmp_path, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 2 and result.stdout == "", result
    assert result.stderr.startswith(message) and result.stderr.count("\n") == 1, result.stderr


@pytest.mark.parametrize(("arguments", "message"), _BAD_COMMAND_LINES)
def test_each_command_checks_its_arguments_before_it_starts(
    arguments: list[str], message: str, tmp_path: Any, monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:  # fmt: skip
    # In this process, as the test above does in a fresh one for a few of them (many interpreters take long).
    _workspace(tmp_path)
    monkeypatch.chdir(tmp_path)
    try:
        status = main(arguments)
    except SystemExit as exit_:  # argparse's own errors
        status = exit_.code
    out, err = capsys.readouterr()
    assert status == 2 and out == "", (status, out, err)
    assert err.startswith(message) and err.count("\n") == 1, err


def test_a_script_that_fails_under_the_doctor_shows_its_own_traceback(tmp_path: Any) -> None:
    (tmp_path / "crash.py").write_text("def main():\n    raise RuntimeError('boom')\n\nmain()\n")
    result = warm_processes.run(
        [sys.executable, "-m", "ember", "doctor", "crash.py"], cwd=tmp_path, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 1, result
    # What `python crash.py` shows: the script's frames only, none of the doctor's or runpy's.
    frames = [line.strip() for line in result.stderr.splitlines() if line.strip().startswith("File ")]
    assert frames == ['File "crash.py", line 4, in <module>', 'File "crash.py", line 2, in main'], result.stderr
    assert result.stderr.startswith("Traceback") and result.stderr.rstrip().endswith("RuntimeError: boom")


def test_a_module_is_found_in_the_current_directory(tmp_path: Any) -> None:
    from ember.cli import _script_problem

    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "__init__.py").write_text("raise SystemExit('not imported by the check')\n")
    assert _script_problem("mine.train", module=True) is None  # the test runs in tmp_path
    assert _script_problem("json", module=True) is None
    assert _script_problem(str(tmp_path / "mine"), module=False) is not None  # a directory without __main__.py


# ------------------------------------------------------------------------------------ warnings
def test_a_warning_every_process_would_give_comes_from_rank_zero_once(monkeypatch: pytest.MonkeyPatch) -> None:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        monkeypatch.setattr(rank_zero_only, "rank", 1)
        build_precision("16-mixed", torch.device("cpu"))
        monkeypatch.setattr(rank_zero_only, "rank", 0)
        build_precision("16-mixed", torch.device("cpu"))
        build_precision("16-mixed", torch.device("cpu"))  # a second Trainer in the same process
    assert [str(warning.message)[:36] for warning in caught] == ["precision='16-mixed' needs a GPU (fl"]


def test_rank_zero_warn_once_points_where_warnings_warn_would() -> None:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        rank_zero_warn_once("once", DeprecationWarning)
        rank_zero_warn_once("once", DeprecationWarning)
        rank_zero_warn_once("once")  # another category: another warning
    assert [(warning.category, warning.filename) for warning in caught] == [
        (DeprecationWarning, __file__), (UserWarning, __file__)
    ]  # fmt: skip


def test_a_warning_that_would_come_at_every_save_comes_once() -> None:
    class WithObject(Regressor):
        def __init__(self, lr: float = 0.05, loss_fn: Any = None) -> None:
            super().__init__(lr)
            self.save_hyperparameters()

    trainer = quiet_trainer(max_epochs=3, logger=False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(WithObject(loss_fn=torch.nn.MSELoss()), make_loader(16))
    dropped = [warning for warning in caught if "is a MSELoss, which checkpoints do not store" in str(warning.message)]
    assert len(dropped) == 1, [str(warning.message) for warning in caught]


class _Logging(Regressor):
    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = super().training_step(batch, batch_idx)
        self.log("train_loss", loss)
        return loss


def _deprecated_flag(tmp_path: Any, monkeypatch: pytest.MonkeyPatch, rank: int) -> None:
    monkeypatch.setattr(rank_zero_only, "rank", rank)  # as the launcher's RANK sets it before a Trainer exists
    ember.Trainer(gpus=0, logger=False)


def _log_with_barebones(tmp_path: Any, monkeypatch: pytest.MonkeyPatch, rank: int) -> None:
    trainer = quiet_trainer(max_epochs=2, barebones=True)
    monkeypatch.setattr(rank_zero_only, "rank", rank)
    trainer.fit(_Logging(), make_loader(32))  # self.log at each of 8 steps


def _validate_without_a_model(tmp_path: Any, monkeypatch: pytest.MonkeyPatch, rank: int) -> None:
    trainer = quiet_trainer(max_epochs=1, logger=False, default_root_dir=str(tmp_path / f"{rank}"))
    trainer.fit(Regressor(), make_loader(16), make_loader(16))
    monkeypatch.setattr(rank_zero_only, "rank", rank)
    trainer.validate(dataloaders=make_loader(16))  # the best checkpoint is loaded, with a warning


def _a_damaged_checkpoint_passed_over(tmp_path: Any, monkeypatch: pytest.MonkeyPatch, rank: int) -> None:
    from ember.callbacks import ModelCheckpoint

    directory = tmp_path / "checkpoints"
    directory.mkdir(exist_ok=True)
    for saved in directory.glob("*.ckpt"):  # what the last call saved: "last" would resume from it
        saved.unlink()
    (directory / "damaged.ckpt").write_bytes(b"not a checkpoint")
    trainer = quiet_trainer(max_epochs=1, logger=False, callbacks=[ModelCheckpoint(dirpath=str(directory))])
    monkeypatch.setattr(rank_zero_only, "rank", rank)
    trainer.fit(Regressor(), make_loader(16), ckpt_path="last")


@pytest.mark.parametrize(
    ("cause", "message", "given"),
    [
        (_deprecated_flag, "gpus=0 is Lightning 1's spelling", 1),
        (_log_with_barebones, "self.log('train_loss', ...) does nothing: `Trainer(barebones=True)` is configured", 1),
        (_validate_without_a_model, ".validate(ckpt_path=None)` was called without a model", 2),  # at each call
        (_a_damaged_checkpoint_passed_over, 'ckpt_path="last": passing over', 2),  # each resume that does it
    ],
    ids=lambda value: getattr(value, "__name__", ""),
)
def test_warnings_come_from_rank_zero_and_once_when_they_would_repeat(
    cause: Any, message: str, given: int, tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    def warned(rank: int, times: int) -> int:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")  # Python's own once-per-place filter would hide repeats
            for _ in range(times):
                cause(tmp_path, monkeypatch, rank)
        return sum(message in str(warning.message) for warning in caught)

    assert warned(rank=1, times=1) == 0
    assert warned(rank=0, times=2) == given


def test_a_loader_warning_comes_from_rank_zero_only(monkeypatch: pytest.MonkeyPatch) -> None:
    from torch.utils.data import DataLoader

    from ember.data import _shardable

    class Custom(torch.utils.data.Sampler):
        def __iter__(self) -> Any:
            return iter(range(4))

        def __len__(self) -> int:
            return 4

    loader = DataLoader(list(range(4)), sampler=Custom(), batch_size=2)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        monkeypatch.setattr(rank_zero_only, "rank", 1)
        assert not _shardable(loader)
    assert caught == []


# ------------------------------------------------------------------------------------ hardware
def test_more_devices_than_the_machine_has_says_what_to_pass() -> None:
    cores = os.cpu_count() or 1
    with pytest.raises(ValueError, match=rf"devices={cores + 1}, but this machine has {cores} CPU cores?; "
                                         rf"pass devices={cores} or fewer"):  # fmt: skip
        ember.Trainer(accelerator="cpu", devices=cores + 1)


# --------------------------------------------------------------------------- files others read
def test_hparams_yaml_is_yaml_with_a_repr_for_what_yaml_cannot_hold(tmp_path: Any) -> None:
    import numpy
    import yaml

    from ember.loggers import CSVLogger

    logger = CSVLogger(str(tmp_path))
    logger.log_hyperparams({
        "lr": numpy.float32(0.5), "layers": (64, 32), "name": "run: one", "steps": numpy.int64(3), "none": None,
        "loss_fn": torch.nn.MSELoss(), "optimizer": {"betas": [0.9, 0.99], "dtype": torch.float16},
    })  # fmt: skip
    with open(os.path.join(logger.log_dir, "hparams.yaml")) as file:
        text = file.read()
    assert not text.startswith("{") and "lr: 0.5\n" in text  # block style, not JSON
    assert yaml.safe_load(text) == {
        "lr": 0.5, "layers": [64, 32], "name": "run: one", "steps": 3, "none": None,
        "loss_fn": "MSELoss()", "optimizer": {"betas": [0.9, 0.99], "dtype": "torch.float16"},
    }  # fmt: skip


@pytest.mark.parametrize("umask", [0o002, 0o022, 0o077])
def test_logs_and_checkpoints_follow_the_umask(umask: int, tmp_path: Any) -> None:
    previous = os.umask(umask)
    try:
        trainer = quiet_trainer(max_epochs=1, default_root_dir=str(tmp_path), profiler="simple", log_every_n_steps=1)
        trainer.fit(Regressor(), make_loader(16))
    finally:
        os.umask(previous)
    run = trainer.log_dir
    assert run is not None
    written = {os.path.relpath(os.path.join(root, name), run): os.stat(os.path.join(root, name)).st_mode & 0o777
               for root, directories, files in os.walk(run) for name in directories + files}  # fmt: skip
    assert {"metrics.csv", "hparams.yaml", "fit-profile.txt", "checkpoints"} <= set(written), written
    for path, mode in written.items():
        expected = (0o777 if os.path.isdir(os.path.join(run, path)) else 0o666) & ~umask
        assert mode == expected, (path, oct(mode), oct(expected))


def test_fit_says_which_limit_ended_it_through_the_ember_logger(caplog: pytest.LogCaptureFixture) -> None:
    class StopsEarly(Regressor):
        def on_train_epoch_end(self) -> None:
            self.trainer.should_stop = True

    ended = []
    for flags, module in (({"max_epochs": 2}, Regressor()), ({"max_steps": 3}, Regressor()),
                          ({"max_epochs": 5}, StopsEarly())):  # fmt: skip
        caplog.clear()
        with caplog.at_level("INFO", logger="ember"):
            quiet_trainer(logger=False, **flags).fit(module, make_loader(32))
        ended.append([record.getMessage() for record in caplog.records if "stopped" in record.getMessage()])
    assert ended == [
        ["`Trainer.fit` stopped: `max_epochs=2` reached."],
        ["`Trainer.fit` stopped: `max_steps=3` reached."],
        [],
    ]
