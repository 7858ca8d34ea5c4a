"""The fast path: TF32 matmuls, torch.compile, and the throughput and MFU figures of ThroughputMonitor."""

from __future__ import annotations

import time
from collections.abc import Iterator, Mapping
from typing import Any

import pytest
import torch
from conftest import Regressor, make_loader, parameters_of, quiet_trainer

from ember.callbacks import ThroughputMonitor
from ember.callbacks.throughput import peak_flops
from ember.loggers import Logger


@pytest.fixture
def _restore_matmul_precision() -> Iterator[None]:
    previous = torch.get_float32_matmul_precision()
    yield
    torch.set_float32_matmul_precision(previous)


@pytest.mark.usefixtures("_restore_matmul_precision")
def test_float32_matmul_precision_sets_torch() -> None:
    quiet_trainer(float32_matmul_precision="high")
    assert torch.get_float32_matmul_precision() == "high"
    quiet_trainer(float32_matmul_precision="highest")
    assert torch.get_float32_matmul_precision() == "highest"
    quiet_trainer()  # None leaves the setting alone
    assert torch.get_float32_matmul_precision() == "highest"


class _Metrics(Logger):
    def __init__(self) -> None:
        self.rows: list[tuple[int, dict[str, float]]] = []

    def log_metrics(self, metrics: Mapping[str, float], step: int) -> None:
        self.rows.append((step, dict(metrics)))

    def throughput(self) -> list[tuple[int, dict[str, float]]]:
        return [(step, row) for step, row in self.rows if any(key.startswith("throughput/") for key in row)]


class _Compiled(Regressor):
    """Records whether its forward was traced by torch.compile."""

    compiled = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch.compiler.is_compiling():
            self.compiled = True
        return self.layer(x)


@pytest.mark.slow
def test_a_compiled_run_measures_flops_checkpoints_and_resumes_uncompiled() -> None:
    uninterrupted = Regressor()
    quiet_trainer(max_epochs=3, logger=False, enable_checkpointing=False).fit(uninterrupted, make_loader())

    model, logger = _Compiled(), _Metrics()
    monitor = ThroughputMonitor(log_every_n_steps=2)
    trainer = quiet_trainer(max_epochs=2, compile={"dynamic": False}, logger=logger, enable_checkpointing=False,
                            callbacks=[monitor])  # fmt: skip
    trainer.fit(model, make_loader(), make_loader())
    # Counting FLOPs in the first batch must not keep torch.compile from compiling the model afterwards.
    assert model.compiled
    assert monitor.flops_per_sample == 16  # Linear(4, 1): 2*4 forward + 2*4 for the weight's gradient
    assert logger.throughput() and all("throughput/tflops_per_sec" in row for _, row in logger.throughput())

    trainer.save_checkpoint("compiled.ckpt")
    state = torch.load("compiled.ckpt")["state_dict"]
    assert list(state) == list(Regressor().state_dict())  # no "_orig_mod." prefix
    resumed = Regressor()
    quiet_trainer(max_epochs=3, logger=False, enable_checkpointing=False).fit(
        resumed, make_loader(), ckpt_path="compiled.ckpt"
    )
    for got, expected in zip(parameters_of(resumed), parameters_of(uninterrupted)):
        torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


class _Sleepy(Regressor):
    """Training batches take 5 ms, validation batches 100 ms: if validation were timed, rates would collapse."""

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        time.sleep(0.005)
        return super().training_step(batch, batch_idx)

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        time.sleep(0.1)


def test_throughput_figures_are_logged_per_window_without_validation_time() -> None:
    logger = _Metrics()
    monitor = ThroughputMonitor(peak_flops=1e6)
    trainer = quiet_trainer(max_epochs=2, logger=logger, log_every_n_steps=4, val_check_interval=2,
                            enable_checkpointing=False, callbacks=[monitor])  # fmt: skip
    trainer.fit(_Sleepy(), make_loader(64, batch_size=8), make_loader(8, batch_size=8))

    rows = logger.throughput()
    assert [step for step, _ in rows] == [4, 8, 12, 16]  # the first two batches are a warm-up
    for _, row in rows:
        assert set(row) == {"throughput/batches_per_sec", "throughput/samples_per_sec", "throughput/tflops_per_sec",
                            "throughput/mfu", "epoch"}  # fmt: skip
        assert 30 < row["throughput/batches_per_sec"] <= 200  # at most one batch per 5 ms
        assert row["throughput/samples_per_sec"] == pytest.approx(8 * row["throughput/batches_per_sec"])
        flops = 16 * row["throughput/samples_per_sec"]
        assert row["throughput/tflops_per_sec"] == pytest.approx(flops / 1e12)
        assert row["throughput/mfu"] == pytest.approx(flops / 1e6)
    last = rows[-1][1]["throughput/samples_per_sec"]
    assert trainer.logged_metrics["throughput/samples_per_sec"] == pytest.approx(last)


def test_given_flops_and_batch_size_fn_are_used_and_none_logs_no_flop_figures() -> None:
    logger = _Metrics()
    monitor = ThroughputMonitor(flops_per_sample=1000.0, batch_size_fn=lambda batch: 2 * len(batch[0]))
    trainer = quiet_trainer(max_epochs=1, logger=logger, log_every_n_steps=3, enable_checkpointing=False,
                            callbacks=[monitor])  # fmt: skip
    trainer.fit(Regressor(), make_loader(64, batch_size=8))
    (_, row), *_ = logger.throughput()
    assert row["throughput/samples_per_sec"] == pytest.approx(16 * row["throughput/batches_per_sec"])
    assert row["throughput/tflops_per_sec"] == pytest.approx(1000.0 * row["throughput/samples_per_sec"] / 1e12)
    assert "throughput/mfu" not in row  # no peak known for a CPU

    logger = _Metrics()
    trainer = quiet_trainer(max_epochs=1, logger=logger, log_every_n_steps=3, enable_checkpointing=False,
                            callbacks=[ThroughputMonitor(flops_per_sample=None)])  # fmt: skip
    trainer.fit(Regressor(), make_loader(64, batch_size=8))
    assert {key for _, row in logger.throughput() for key in row} == {
        "throughput/batches_per_sec", "throughput/samples_per_sec", "epoch"
    }  # fmt: skip


@pytest.mark.parametrize(
    ("device_name", "precision", "matmul", "peak"),
    [("NVIDIA H100 80GB HBM3", "bf16-mixed", "highest", 989.4e12),
     ("NVIDIA H100 80GB HBM3", "32-true", "highest", 67e12),
     ("NVIDIA H100 80GB HBM3", "32-true", "high", 494.7e12),
     ("NVIDIA H100 PCIe", "16-mixed", "highest", 756.5e12),
     ("NVIDIA H200", "bf16-true", "highest", 989.4e12),
     ("NVIDIA A100-SXM4-80GB", "64-true", "highest", 19.5e12),
     ("NVIDIA A10G", "bf16-mixed", "highest", 125e12),
     ("NVIDIA L40S", "16-mixed", "highest", 362e12),
     ("NVIDIA L4", "32-true", "medium", 60e12),
     ("Tesla V100-SXM2-16GB", "32-true", "high", 15.7e12),  # no TF32 before Ampere
     ("Tesla V100-SXM2-16GB", "bf16-mixed", "highest", None),
     ("NVIDIA GeForce RTX 4090", "bf16-mixed", "highest", 165.2e12),
     ("Some Future GPU", "bf16-mixed", "highest", None)],
)  # fmt: skip
@pytest.mark.usefixtures("_restore_matmul_precision")
def test_peak_flops_of_common_gpus(
    monkeypatch: pytest.MonkeyPatch, device_name: str, precision: str, matmul: str, peak: float | None
) -> None:
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: device_name)
    torch.set_float32_matmul_precision(matmul)
    assert peak_flops(torch.device("cuda", 0), precision) == peak
    assert peak_flops(torch.device("cpu"), precision) is None


@pytest.mark.parametrize(
    ("options", "message"),
    [({"flops_per_sample": 0}, r"flops_per_sample=0\): expected a positive number, 'measure' or None"),
     ({"flops_per_sample": "count"}, r"flops_per_sample='count'"),
     ({"peak_flops": -1.0}, r"peak_flops=-1.0\): expected a positive number of FLOP/s"),
     ({"batch_size_fn": 8}, r"batch_size_fn=8\): expected a function of the batch"),
     ({"log_every_n_steps": 0}, r"log_every_n_steps=0\): expected an int >= 1")],
)  # fmt: skip
def test_bad_throughput_monitor_options_are_refused(options: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        ThroughputMonitor(**options)


def test_throughput_monitor_needs_a_logger() -> None:
    trainer = quiet_trainer(max_epochs=1, logger=False, callbacks=[ThroughputMonitor()])
    with pytest.raises(ValueError, match="ThroughputMonitor needs a logger"):
        trainer.fit(Regressor(), make_loader())


def test_a_model_without_counted_operations_warns_and_logs_no_flop_figures() -> None:
    class Elementwise(Regressor):
        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            return (self.layer.weight * batch[0][:, :4].mean()).sum()

    monitor = ThroughputMonitor()
    trainer = quiet_trainer(max_epochs=1, logger=_Metrics(), enable_checkpointing=False, callbacks=[monitor])
    with pytest.warns(UserWarning, match="counted no FLOPs in the first training batch"):
        trainer.fit(Elementwise(), make_loader())
    assert monitor.flops_per_sample is None


@pytest.mark.cuda
def test_throughput_and_mfu_on_a_gpu() -> None:
    logger = _Metrics()
    known = peak_flops(torch.device("cuda", 0), "16-mixed") is not None
    monitor = ThroughputMonitor(peak_flops=None if known else 1e14)
    trainer = quiet_trainer(accelerator="cuda", devices=1, precision="16-mixed", max_epochs=1, logger=logger,
                            log_every_n_steps=2, enable_checkpointing=False, callbacks=[monitor])  # fmt: skip
    trainer.fit(Regressor(), make_loader())
    assert monitor.flops_per_sample == 16
    rows = logger.throughput()
    assert rows and all(0 < row["throughput/mfu"] < 1 for _, row in rows)


@pytest.mark.cuda
@pytest.mark.slow
def test_compiled_mixed_precision_training_on_a_gpu() -> None:
    model = _Compiled()
    trainer = quiet_trainer(accelerator="cuda", devices=1, precision="16-mixed", compile=True, max_epochs=2,
                            logger=False, enable_checkpointing=False)  # fmt: skip
    trainer.fit(model, make_loader(), make_loader())
    assert model.compiled
    assert model.layer.weight.isfinite().all()
