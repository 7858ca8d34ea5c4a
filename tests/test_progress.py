"""The progress bar: what a terminal shows (width, epochs, samples/s), lines in logs, the validation bar,
the finders' progress, and that drawing reads the device once per redraw and never per step."""

from __future__ import annotations

import contextlib
import fcntl
import io
import os
import pty
import re
import select
import signal
import struct
import sys
import termios
import time
from typing import Any

import pytest
import torch
import warm_processes
from conftest import Regressor, make_loader, quiet_trainer

import ember
from ember.callbacks import ProgressBar, ProgressBarBase, RichProgressBar, TQDMProgressBar
from ember.loggers import CSVLogger
from ember.rank_zero import rank_zero_only
from ember.tuner import Tuner

EXAMPLES = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples")


class _Terminal(io.StringIO):
    """A stream that says it is a terminal."""

    def isatty(self) -> bool:
        return True


class _Clock:
    """A clock that moves only when told: the progress bar's timings become exact."""

    def __init__(self) -> None:
        self.now = 1000.0

    def monotonic(self) -> float:
        return self.now


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> _Clock:
    fake = _Clock()
    monkeypatch.setattr("ember.callbacks.progress.time", fake)
    return fake


class _Timed(Regressor):
    """Each training step takes ``seconds`` on the fake clock; logs ``extras`` with ``prog_bar=True``."""

    def __init__(self, clock: _Clock | None = None, seconds: float = 0.0, extras: tuple[str, ...] = ()) -> None:
        super().__init__()
        self.clock, self.seconds, self.extras = clock, seconds, extras

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        if self.clock is not None:
            self.clock.now += self.seconds
        loss = super().training_step(batch, batch_idx)
        self.log("train_loss", loss, prog_bar=True)  # the loss itself: shown once, under this name
        for name in self.extras:
            self.log(name, 2 * loss.detach(), prog_bar=True)
        return loss


def _screen(output: str) -> list[str]:
    """The lines a terminal shows after ``output`` (carriage returns, line feeds and cursor-up applied)."""
    lines, row, column = [""], 0, 0
    for token in re.findall(r"\x1b\[A|\r|\n|[^\r\n\x1b]+", output):
        if token == "\r":
            column = 0
        elif token == "\n":
            row, column = row + 1, 0
            lines += [""] * (row + 1 - len(lines))
        elif token == "\x1b[A":
            row = max(row - 1, 0)
        else:
            line = lines[row].ljust(column)
            lines[row] = line[:column] + token + line[column + len(token) :]
            column += len(token)
    return [line.rstrip() for line in lines if line.strip()]


def _segments(output: str) -> list[str]:
    """What each write of a line put on the screen: the text between carriage returns and line feeds."""
    return [segment for segment in re.split(r"\r|\n|\x1b\[A", output) if segment]


# ---------------------------------------------------------------------------------- a terminal
def _run_in_terminal(arguments: list[str], columns: int, cwd: Any, timeout: float) -> list[tuple[float, str]]:
    """Run ``python ARGUMENTS`` on a pseudo-terminal ``columns`` wide; what it wrote, with the time each part came."""
    main, child = pty.openpty()
    fcntl.ioctl(child, termios.TIOCSWINSZ, struct.pack("HHHH", 24, columns, 0, 0))
    env = {name: value for name, value in os.environ.items() if name != "COLUMNS"}
    with open(os.path.join(cwd, "stderr.txt"), "w") as errors:
        process = warm_processes.Popen(
            [sys.executable, *arguments], stdin=child, stdout=child, stderr=errors, cwd=cwd,
            env={**env, "OMP_NUM_THREADS": "1"}, start_new_session=True,
        )  # fmt: skip
    os.close(child)
    parts: list[tuple[float, str]] = []
    deadline = time.monotonic() + timeout
    try:
        while time.monotonic() < deadline:
            if select.select([main], [], [], 0.5)[0]:
                try:
                    data = os.read(main, 1 << 16)
                except OSError:  # the child's side is closed
                    break
                if not data:
                    break
                parts.append((time.monotonic(), data.decode("utf-8", errors="replace")))
            elif process.poll() is not None:
                break
        else:
            os.killpg(process.pid, signal.SIGKILL)
            pytest.fail(f"{arguments} did not finish in {timeout} s")
    finally:
        os.close(main)
    with open(os.path.join(cwd, "stderr.txt")) as errors:
        assert process.wait() == 0, errors.read()[-3000:]
    return parts


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_digits_on_an_80_column_terminal(tmp_path: Any) -> None:
    pytest.importorskip("sklearn")
    arguments = [os.path.join(EXAMPLES, "digits.py"), "--root-dir", str(tmp_path), "--max-epochs", "3", "--target", "0"]
    parts = _run_in_terminal(arguments, columns=80, cwd=tmp_path, timeout=150)
    output = "".join(text for _, text in parts)
    # No line wider than the terminal, so none wraps (the example's own lines at the end neither); each
    # redraw rewrites the line in place.
    assert max(len(segment) for segment in _segments(output)) <= 80
    output = output[: output.index("best val_acc")]  # what the example prints itself, after fit
    assert "\r" in output
    epochs = [line for line in _screen(output) if line.startswith("Epoch ")]
    assert [line.split()[1] for line in epochs] == ["0/2", "1/2", "2/2"], epochs  # one line per epoch stays
    assert all(line.split()[2] == "23/23" and "val_acc=" in line for line in epochs), epochs

    # At most ~10 redraws a second.
    redraws = [segment for segment in _segments(output) if segment.startswith("Epoch ")]
    seconds = parts[-1][0] - parts[0][0]
    assert len(redraws) <= 10 * seconds + 2 * 3, (len(redraws), seconds)

    # samples/s of the last epoch: its 1438 samples over the time since the epoch began, which lies between the
    # end of the previous epoch (its last line) and the last epoch's first draw (up to a redraw interval later).
    previous_end = 0.0
    times: list[float] = []
    last = ""
    for at, text in parts:
        for segment in _segments(text):
            if segment.startswith("Epoch 1/2"):
                previous_end = at
            if segment.startswith("Epoch 2/2"):
                times.append(at)
                last = segment
    shown = float(re.search(r"(\d+) samples/s", last).group(1))  # type: ignore[union-attr]
    slowest, fastest = 1438 / (times[-1] - previous_end), 1438 / (times[-1] - times[0])
    assert 0.95 * slowest <= shown <= 1.05 * fastest, (last, slowest, fastest)


def test_samples_per_second_counts_each_batch_with_its_own_size(clock: _Clock) -> None:
    stream = io.StringIO()
    bar = ProgressBar(stream=stream, interactive=False)
    trainer = quiet_trainer(max_epochs=1, callbacks=[bar], enable_progress_bar=True, logger=False)
    trainer.fit(_Timed(clock, seconds=0.01), make_loader(20, batch_size=8))  # batches of 8, 8 and 4, in 0.03 s
    (line,) = stream.getvalue().splitlines()
    assert line.startswith("Epoch 0/0 3/3 00:00 train_loss=") and line.endswith(" 667 samples/s"), line
    assert " loss=" not in line  # the loss, logged as train_loss, is shown once


def test_the_count_ends_where_max_steps_ends_training() -> None:
    def counts(**flags: Any) -> list[str]:
        stream = io.StringIO()
        bar = ProgressBar(stream=stream, interactive=False, line_interval=3600.0)
        trainer = quiet_trainer(callbacks=[bar], enable_progress_bar=True, logger=False, **flags)
        trainer.fit(Regressor(), make_loader(128, batch_size=8))  # 16 batches an epoch
        return [" ".join(line.split()[:3]) for line in stream.getvalue().splitlines()]

    assert counts(max_steps=5) == ["Epoch 0 5/5"]  # not 5/16, with an ETA for all 16
    assert counts(max_steps=20, max_epochs=3) == ["Epoch 0/2 16/16", "Epoch 1/2 4/4"]
    assert counts(max_steps=3, accumulate_grad_batches=2) == ["Epoch 0 6/6"]  # a step every two batches
    assert counts(max_steps=3, max_epochs=1, accumulate_grad_batches=7) == ["Epoch 0/0 16/16"]  # 7 + 7 + 2


# ------------------------------------------------------------------------------------- logs
def test_output_that_is_not_a_terminal_gets_a_line_every_interval_and_at_each_epoch_end(clock: _Clock) -> None:
    stream = io.StringIO()
    bar = ProgressBar(stream=stream, interactive=False, line_interval=5.0)
    trainer = quiet_trainer(max_epochs=2, callbacks=[bar], enable_progress_bar=True, logger=False)
    trainer.fit(_Timed(clock, seconds=1.0, extras=("twice",)), make_loader(96, batch_size=8), make_loader(16))
    output = stream.getvalue()
    assert "\r" not in output and "\x1b" not in output
    lines = output.splitlines()
    starts = [" ".join(line.split()[:3]) for line in lines]
    # a line every 5 s (a step takes 1 s), a line for each validation and one at each epoch's end
    assert starts == [
        "Epoch 0/1 5/12", "Epoch 0/1 10/12", "Validation 2/2 00:00", "Epoch 0/1 12/12",
        "Epoch 1/1 5/12", "Epoch 1/1 10/12", "Validation 2/2 00:00", "Epoch 1/1 12/12",
    ], lines  # fmt: skip
    assert lines[0].startswith("Epoch 0/1 5/12 00:05<00:07 train_loss=") and " 8.0 samples/s twice=" in lines[0]
    assert lines[-1].startswith("Epoch 1/1 12/12 00:12 train_loss=")


def test_values_that_do_not_fit_the_bar_are_on_the_line_that_ends_the_epoch(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("COLUMNS", "80")
    names = ("a_rather_long_metric_name", "another_long_metric_name", "yet_another_metric_name")

    def run() -> str:
        stream = _Terminal()
        trainer = quiet_trainer(max_epochs=2, callbacks=[ProgressBar(stream=stream, refresh_rate=0.0)],
                                enable_progress_bar=True, logger=False)  # fmt: skip
        trainer.fit(_Timed(extras=names), make_loader(64))
        return stream.getvalue()

    output = run()
    redraws = [segment for segment in _segments(output) if segment.startswith("Epoch ")]
    assert max(len(segment) for segment in _segments(output)) <= 80
    assert not any(name in redraw for redraw in redraws for name in names[1:])  # no room for them on the bar
    screen = _screen(output)
    for epoch in ("0/1", "1/1"):
        (first,) = [index for index, line in enumerate(screen) if line.startswith(f"Epoch {epoch} 8/8 ")]
        ended = " ".join(screen[first : first + 3])  # the epoch's line, broken between values to fit
        assert all(f"{name}=" in ended for name in names) and "samples/s" in ended, screen

    monkeypatch.setenv("COLUMNS", "250")  # a wide terminal has room for them on the bar
    redraws = [segment for segment in _segments(run()) if segment.startswith("Epoch 0/1 4/8 ")]
    assert redraws and all(f"{name}=" in redraws[0] for name in names), redraws


def test_printing_through_the_trainer_goes_above_the_bar(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("COLUMNS", "80")

    class Printing(Regressor):
        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            if batch_idx == 4:
                self.print("half way")
            return super().training_step(batch, batch_idx)

        def on_train_epoch_end(self) -> None:
            self.print("epoch", self.current_epoch, "done")

    stream = _Terminal()
    bar = ProgressBar(stream=stream, refresh_rate=0.0)
    trainer = quiet_trainer(max_epochs=2, callbacks=[bar], enable_progress_bar=True, logger=False)
    with contextlib.redirect_stdout(stream):
        trainer.fit(Printing(), make_loader(64))
    screen = _screen(stream.getvalue())
    assert [line.split()[:2] if line.startswith("Epoch") else line for line in screen] == [
        "half way", "epoch 0 done", ["Epoch", "0/1"], "half way", "epoch 1 done", ["Epoch", "1/1"],
        "`Trainer.fit` stopped: `max_epochs=2` reached.",
    ], screen  # fmt: skip


# ------------------------------------------------------------------------------- evaluation
def test_validation_draws_its_own_bar_removed_inside_fit_and_kept_by_validate(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("COLUMNS", "80")
    stream = _Terminal()
    bar = ProgressBar(stream=stream, refresh_rate=0.0)
    trainer = quiet_trainer(max_epochs=1, callbacks=[bar], enable_progress_bar=True, logger=False)

    class Predicting(Regressor):
        def predict_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            return self(batch[0])

    model = Predicting()
    trainer.fit(model, make_loader(32), make_loader(32))
    drawn = stream.getvalue()
    assert any(segment.startswith("Validation 3/4 ") for segment in _segments(drawn))  # drawn while it ran
    assert not any(line.startswith("Validation") for line in _screen(drawn))  # and gone when done

    for run, title in ((trainer.validate, "Validation"), (trainer.test, "Testing"), (trainer.predict, "Predicting")):
        stream.seek(0)
        stream.truncate()
        run(model, make_loader(32))
        screen = _screen(stream.getvalue())
        assert [line.split()[:2] for line in screen] == [[title, "4/4"]], screen
        assert screen[0].endswith("samples/s")


# ---------------------------------------------------------------------------- device reads
def _count_reads(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Record every read of a tensor's value into the host (``tolist``, ``item``, ``float``)."""
    reads: list[str] = []
    for name in ("tolist", "item", "__float__"):
        original = getattr(torch.Tensor, name)

        def counted(tensor: torch.Tensor, *args: Any, _original: Any = original, _name: str = name) -> Any:
            reads.append(_name)
            return _original(tensor, *args)

        monkeypatch.setattr(torch.Tensor, name, counted)
    return reads


def test_each_redraw_reads_the_device_once_and_no_step_reads_it(monkeypatch: pytest.MonkeyPatch) -> None:
    def run(bar: ProgressBar | None) -> int:
        reads = _count_reads(monkeypatch)
        trainer = quiet_trainer(max_epochs=2, callbacks=[bar] if bar else [], enable_progress_bar=bar is not None,
                                logger=False, enable_checkpointing=False, log_every_n_steps=1000)  # fmt: skip
        trainer.fit(_Timed(extras=("twice", "thrice")), make_loader(64))
        monkeypatch.undo()
        return len(reads)

    without = run(None)
    stream = io.StringIO()
    every_batch = run(ProgressBar(stream=stream, interactive=False, line_interval=0.0))
    lines = stream.getvalue().splitlines()
    assert len(lines) == 2 * 8 + 2  # each batch, and each epoch's end
    assert every_batch - without == len(lines)  # the loss and three values: one read per line

    rarely = run(ProgressBar(stream=io.StringIO(), interactive=False, line_interval=3600.0))
    assert rarely - without == 2  # no read at the steps: only the two epochs' last lines read values


# ---------------------------------------------------------------------------------- finders
class _Sized(ember.Module):
    def __init__(self, batch_size: int = 8, lr: float = 0.01, limit: int = 10**9) -> None:
        super().__init__()
        self.save_hyperparameters()
        torch.manual_seed(0)
        self.layer = torch.nn.Linear(4, 1)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        if len(x) > self.hparams.limit:
            raise torch.OutOfMemoryError(f"{len(x)} samples do not fit")
        return torch.nn.functional.mse_loss(self.layer(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=self.hparams.lr)

    def train_dataloader(self) -> Any:
        return make_loader(256, batch_size=self.hparams.batch_size, shuffle=True)


def test_the_finders_show_each_trial_and_the_sweep(capsys: pytest.CaptureFixture[str]) -> None:
    stream = io.StringIO()
    trainer = quiet_trainer(callbacks=[ProgressBar(stream=stream, interactive=False, line_interval=0.0)],
                            enable_progress_bar=True)  # fmt: skip
    Tuner(trainer).scale_batch_size(_Sized(limit=40), mode="power", init_val=8, steps_per_trial=2)
    trials = capsys.readouterr().out.splitlines()
    assert [re.sub(r" \(.*\)$", "", line) for line in trials] == [
        "Batch size 8 succeeded, trying batch size 16",
        "Batch size 16 succeeded, trying batch size 32",
        "Batch size 32 succeeded, trying batch size 64",
        "Batch size 64 failed",
        "Finished batch size finder, will continue with full run using batch size 32",
    ], trials
    assert re.search(r"\(trial 1: fits, 2 steps in \d+\.\d\d s\)$", trials[0])
    assert trials[3].endswith("(trial 4: runs out of memory)")

    Tuner(trainer).lr_find(_Sized(), min_lr=1e-4, max_lr=1e-1, num_training=20, early_stop_threshold=None)
    sweep = stream.getvalue().splitlines()
    assert [line.split()[1] for line in sweep] == [f"{step}/20" for step in range(1, 21)] + ["20/20"]
    assert all(line.startswith("lr_find ") and " lr=" in line and " loss=" in line for line in sweep)
    assert re.fullmatch(r"lr_find: suggested lr=\S+ \(20 steps\)", capsys.readouterr().out.strip())


def test_the_finders_are_quiet_off_rank_zero(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    stream = io.StringIO()
    trainer = quiet_trainer(callbacks=[ProgressBar(stream=stream, interactive=False, line_interval=0.0)],
                            enable_progress_bar=True)  # fmt: skip
    monkeypatch.setattr(ember.Trainer, "is_global_zero", property(lambda self: False))
    monkeypatch.setattr(rank_zero_only, "rank", 1)  # their messages are logged on rank zero only
    Tuner(trainer).scale_batch_size(_Sized(limit=40), init_val=8, steps_per_trial=1)
    Tuner(trainer).lr_find(_Sized(), num_training=10)
    assert capsys.readouterr().out == "" and stream.getvalue() == ""


def test_progress_bar_can_be_turned_off(capsys: pytest.CaptureFixture[str]) -> None:
    ember.Trainer(accelerator="cpu", max_epochs=1, enable_progress_bar=False, logger=False).fit(
        Regressor(), make_loader(16)
    )
    assert "Epoch" not in capsys.readouterr().out


def test_a_disabled_bar_draws_nothing_and_lightning_bars_read_their_refresh_rate_back() -> None:
    stream = io.StringIO()
    bar = ProgressBar(stream=stream, interactive=False)
    bar.disable()
    assert (bar.is_enabled, bar.is_disabled) == (False, True)
    trainer = quiet_trainer(max_epochs=1, logger=False, enable_progress_bar=True, callbacks=[bar])
    trainer.fit(Regressor(), make_loader(16), make_loader(8))
    assert stream.getvalue() == "" and bar.total_train_batches == 2 and bar.total_val_batches == 1
    bar.enable()
    trainer.validate(Regressor(), make_loader(8), verbose=False)
    assert bar.is_enabled and stream.getvalue().startswith("Validation 1/1")
    assert TQDMProgressBar(refresh_rate=5).refresh_rate == 5 and TQDMProgressBar(refresh_rate=5).is_enabled
    assert TQDMProgressBar(refresh_rate=0).is_disabled
    with pytest.raises(ValueError, match=r"enable_progress_bar=False` but found `TQDMProgressBar`"):
        ember.Trainer(enable_progress_bar=False, callbacks=[TQDMProgressBar()])


def test_the_progress_bar_checks_its_arguments() -> None:
    with pytest.raises(ValueError, match=r"ProgressBar\(interactive='yes'\): expected True, False or None"):
        ProgressBar(interactive="yes")  # type: ignore[arg-type]


def test_a_trainer_takes_one_progress_bar() -> None:
    with pytest.raises(ValueError, match=r"multiple progress bar callbacks.*\['ProgressBar', 'TQDMProgressBar'\]"):
        ember.Trainer(callbacks=[ProgressBar(), TQDMProgressBar()])


def test_a_text_version_shows_its_last_four_characters_as_v_num(tmp_path: Any) -> None:
    bar = ProgressBar(stream=io.StringIO(), interactive=False)
    logger = CSVLogger(str(tmp_path), version="2026-11-27-run")
    trainer = quiet_trainer(max_steps=1, logger=logger, enable_progress_bar=True, callbacks=[bar])
    model = Regressor()
    trainer.fit(model, make_loader(16))
    assert bar.get_metrics(trainer, model) == {"v_num": "-run"}


def test_a_subclass_s_get_metrics_chooses_the_values_the_bar_shows() -> None:
    class Chosen(ProgressBar):
        def get_metrics(self, trainer: Any, pl_module: Any) -> dict[str, float | int | str]:
            items = super().get_metrics(trainer, pl_module)
            items.pop("v_num", None)
            return {**items, "mine": 123}

    class Logging(Regressor):
        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            loss = super().training_step(batch, batch_idx)
            self.log("shown", 2.0, prog_bar=True)
            return loss

    stream = io.StringIO()
    trainer = quiet_trainer(
        max_epochs=1, enable_progress_bar=True, callbacks=[Chosen(stream=stream, interactive=False)]
    )
    trainer.fit(Logging(), make_loader(16))
    last_line = stream.getvalue().splitlines()[-1]
    assert "mine=123" in last_line and "shown=2" in last_line and "v_num" not in last_line


def test_v_num_joins_the_versions_of_several_loggers_and_is_left_out_without_one(tmp_path: Any) -> None:
    bar = ProgressBar(stream=io.StringIO(), interactive=False)
    loggers = [CSVLogger(str(tmp_path), version=1), CSVLogger(str(tmp_path), version="x")]
    trainer = quiet_trainer(max_steps=1, logger=loggers, enable_progress_bar=True, callbacks=[bar])
    model = Regressor()
    trainer.fit(model, make_loader(16))
    assert bar.get_metrics(trainer, model) == {"v_num": "1_x"}
    trainer = quiet_trainer(fast_dev_run=True, enable_progress_bar=True, callbacks=[bar])
    trainer.fit(model, make_loader(16))
    assert bar.get_metrics(trainer, model) == {}  # the DummyLogger has no version


def test_the_bar_turns_itself_off_on_other_ranks_than_global_zero() -> None:
    bar = ProgressBar()
    bar.setup(quiet_trainer(), Regressor(), "fit")
    assert bar.is_enabled
    other_rank = type("OtherRank", (), {"is_global_zero": False})()
    bar.setup(other_rank, Regressor(), "fit")  # type: ignore[arg-type]
    assert bar.is_disabled


def test_tqdm_refresh_rate_follows_colab_and_tqdm_miniters(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TQDM_MINITERS", "2")
    assert [TQDMProgressBar(refresh_rate=rate).refresh_rate for rate in (0, 1, 5)] == [2, 2, 5]
    monkeypatch.delenv("TQDM_MINITERS")
    monkeypatch.setenv("COLAB_GPU", "1")
    assert [TQDMProgressBar().refresh_rate, TQDMProgressBar(refresh_rate=19).refresh_rate] == [20, 19]


def test_a_bar_can_be_pickled_after_a_stage() -> None:
    import pickle

    bar = ProgressBar(interactive=False, stream=io.StringIO())
    trainer = quiet_trainer(max_epochs=1, enable_progress_bar=True, callbacks=[bar])
    trainer.fit(Regressor(), make_loader(16))
    copy = pickle.loads(pickle.dumps(bar))
    assert copy.is_enabled and copy.refresh_rate == bar.refresh_rate


def test_a_subclass_names_the_evaluation_bars() -> None:
    class Named(ProgressBar):
        @property
        def validation_description(self) -> str:
            return "Checking"

        @property
        def test_description(self) -> str:
            return "Exam"

    stream = io.StringIO()
    trainer = quiet_trainer(enable_progress_bar=True, callbacks=[Named(stream=stream, interactive=False)])
    trainer.validate(Regressor(), make_loader(8), verbose=False)
    trainer.test(Regressor(), make_loader(8), verbose=False)
    assert [line.split()[0] for line in stream.getvalue().splitlines()] == ["Checking", "Exam"]
    assert ProgressBar().predict_description == "Predicting"


def test_a_bar_on_the_base_class_draws_nothing_but_what_it_chooses(capsys: pytest.CaptureFixture[str]) -> None:
    class Quiet(ProgressBarBase):
        pass

    bar = Quiet()
    trainer = quiet_trainer(max_epochs=1, enable_progress_bar=True, callbacks=[bar])
    assert trainer.progress_bar_callback is bar
    trainer.fit(Regressor(), make_loader(16), make_loader(8))
    trainer.print("only this")
    # The Trainer's own lines only: the bar draws nothing.
    assert capsys.readouterr().out == "`Trainer.fit` stopped: `max_epochs=1` reached.\nonly this\n"
    assert bar.total_train_batches == 2
    assert Tuner(trainer).lr_find(Regressor(), make_loader(64), num_training=5) is not None  # no display to draw
    with pytest.raises(ValueError, match="multiple progress bar callbacks"):
        ember.Trainer(callbacks=[Quiet(), ProgressBar()])


def test_lightnings_titles_and_the_unset_trainer() -> None:
    bar = TQDMProgressBar()
    titles = [bar.sanity_check_description, bar.train_description, bar.validation_description]
    assert titles == ["Sanity Checking", "Training", "Validation"]
    with pytest.raises(TypeError, match=r"The `TQDMProgressBar.trainer` reference has not been set yet"):
        bar.trainer  # noqa: B018  (before a stage sets it up)


def test_the_training_total_counts_the_steps_left_without_an_epoch_limit() -> None:
    totals: list[float] = []

    class Totals(TQDMProgressBar):
        def on_train_epoch_start(self, trainer: Any, pl_module: Any) -> None:
            totals.append(self.total_train_batches)

    trainer = quiet_trainer(max_epochs=-1, max_steps=3, logger=False, enable_progress_bar=True,
                            callbacks=[Totals(refresh_rate=0)])  # fmt: skip
    trainer.fit(Regressor(), make_loader(64))
    assert totals == [3]  # the epoch has 8 batches; 3 steps are left
    bounded = Totals(refresh_rate=0)
    trainer = quiet_trainer(max_epochs=1, max_steps=3, logger=False, enable_progress_bar=True, callbacks=[bounded])
    trainer.fit(Regressor(), make_loader(64))
    assert totals == [3, 8]  # as Lightning's: bounded by max_steps only when max_epochs=-1


def test_a_rich_bar_keeps_its_theme() -> None:
    from ember.callbacks.progress_bars import RichProgressBarTheme

    theme = RichProgressBarTheme(description="green_yellow", metrics="grey82")
    bar = RichProgressBar(theme=theme, leave=True)
    assert bar.theme is theme and bar.refresh_rate == 100 and bar.is_enabled  # Lightning's default rate
    assert RichProgressBar().theme == RichProgressBarTheme() and RichProgressBarTheme().metrics_format == ".3f"
    assert RichProgressBar(refresh_rate=0).is_disabled
