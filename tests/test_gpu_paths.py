"""The GPU paths: each mechanism pinned on CPU (the device a loader or strategy chooses, the autocast a
thread enters, where a collective's tensor lives), and the same paths run for real by tests marked cuda."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from types import SimpleNamespace
from typing import Any

import pytest
import torch
import warm_processes
from torch.utils.data import DataLoader

import ember
from ember._utils import apply_to_tensors
from ember.data import prepare_loader

SCRIPTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "scripts")


class _OnAGPU:
    """Just enough of a strategy for prepare_loader: one process on cuda:0."""

    root_device = torch.device("cuda", 0)
    distributed_sampler_kwargs = None


class _OnCPU(_OnAGPU):
    root_device = torch.device("cpu")


# ---------------------------------------------------------------------------------- pinned memory
def test_only_cpu_tensors_of_batches_bound_for_a_gpu_are_pinned(monkeypatch: pytest.MonkeyPatch) -> None:
    pinned: list[str] = []
    monkeypatch.setattr(torch.Tensor, "pin_memory", lambda self, *args: pinned.append(self.device.type) or self)
    # A dataset that yields tensors already on a device (the meta device stands in for the GPU here).
    samples = [(torch.zeros(2, device="meta"), torch.ones(1))] * 4
    prepared = prepare_loader(DataLoader(samples, batch_size=2), _OnAGPU(), train=False)  # type: ignore[arg-type]
    assert not prepared.pin_memory  # the DataLoader's own pinning would fail on the device tensor
    on_device, on_cpu = next(iter(prepared))
    assert on_device.device.type == "meta" and on_cpu.shape == (2, 1)
    assert pinned == ["cpu"]
    # Worker processes hand over CPU tensors only: the loader pins them in its background thread.
    with_workers = prepare_loader(DataLoader(samples, batch_size=2, num_workers=2), _OnAGPU(), train=False)  # type: ignore[arg-type]
    assert with_workers.pin_memory
    assert not prepare_loader(DataLoader(samples, num_workers=2), _OnCPU(), train=False).pin_memory  # type: ignore[arg-type]


# ------------------------------------------------------------------------------- strategy="dp"
class _Fakes:
    """torch.nn.parallel's scatter, replicate and parallel_apply as they behave on GPUs, run on CPU.

    ``parallel_apply`` runs each replica in a thread of its own that re-enters autocast as torch's does:
    enabled as in the calling thread, with the device's default dtype (CUDA's is float16; CPU's is
    bfloat16, so a float16 precision on CPU shows the same loss of the dtype).
    """

    def __init__(self) -> None:
        self.threads: set[int] = set()

    def scatter_kwargs(self, args: tuple[Any, ...], kwargs: Any, device_ids: list[Any]) -> tuple[Any, Any]:
        return tuple(tuple(share) for share in zip(*(_shares(arg, len(device_ids)) for arg in args))), None

    def replicate(self, module: torch.nn.Module, devices: list[Any], detach: bool) -> list[torch.nn.Module]:
        return [module._replicate_for_data_parallel() for _ in devices]

    def parallel_apply(self, functions: list[Any], inputs: Any, kwargs: Any = None, devices: Any = None) -> list[Any]:
        import threading

        autocast, grad = torch.is_autocast_enabled("cpu"), torch.is_grad_enabled()
        results: list[Any] = [None] * len(functions)
        # The replicas' threads run at the same time, as torch's do (and so have distinct identities).
        together = threading.Barrier(len(functions))

        def work(index: int) -> None:
            together.wait(timeout=30)
            self.threads.add(threading.get_ident())
            torch.set_grad_enabled(grad)
            with torch.autocast("cpu", enabled=autocast):
                try:
                    results[index] = functions[index](*inputs[index])
                except Exception as error:  # re-raised in the calling thread, as torch does
                    results[index] = error

        threads = [threading.Thread(target=work, args=(index,)) for index in range(len(functions))]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        for result in results:
            if isinstance(result, Exception):
                raise result
        return results


def _shares(value: Any, count: int) -> list[Any]:
    from ember._utils import split_batch

    return split_batch(value, count) if isinstance(value, (torch.Tensor, tuple, list)) else [value] * count


class _Logs:
    def __init__(self) -> None:
        self.names: list[str] = []

    def log(self, name: str, *args: Any) -> None:
        self.names.append(name)


class _Trainer:
    """What the module reaches through ``self.trainer`` in these steps."""

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        self.run_metrics = _Logs()
        self.config = SimpleNamespace(barebones=False)
        self.fit_loop = SimpleNamespace(lightning_optimizers=[optimizer])


class _Shares(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(4, 1)
        self.seen: list[tuple[bool, torch.dtype, int]] = []

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        import threading

        x, y = batch
        self.seen.append((torch.is_autocast_enabled("cpu"), torch.get_autocast_dtype("cpu"), threading.get_ident()))
        assert self.trainer is not None and self.optimizers() is not None  # on every replica
        self.log("share", float(len(x)))
        return torch.nn.functional.mse_loss(self.layer(x).float(), y)

    def predict_step(self, batch: Any, batch_idx: int, dataloader_idx: int = 0) -> Any:
        x, _ = batch
        out = self.layer(x).float()
        return {"per_sample": out.squeeze(1), "column": out, "count": len(x), "label": "dp"}


def _dp(monkeypatch: pytest.MonkeyPatch, precision: Any) -> tuple[Any, _Fakes]:
    import torch.nn.parallel.scatter_gather

    import ember
    from ember.strategies import DataParallelStrategy

    fakes = _Fakes()
    monkeypatch.setattr(torch.nn.parallel.scatter_gather, "scatter_kwargs", fakes.scatter_kwargs)
    for name in ("replicate", "parallel_apply"):
        monkeypatch.setattr(torch.nn.parallel, name, getattr(fakes, name))

    class Net(_Shares, ember.Module):
        pass

    module = Net()
    module._trainer = _Trainer(torch.optim.SGD(module.parameters(), lr=0.1))  # type: ignore[assignment]
    strategy = DataParallelStrategy()
    strategy.parallel_devices = [torch.device("cpu")] * 2  # two replicas (the fakes ignore devices)
    strategy.precision = precision
    strategy._module = module
    return strategy, fakes


def test_every_replica_of_dp_computes_in_the_precision_dtype(monkeypatch: pytest.MonkeyPatch) -> None:
    from ember.precision import MixedPrecision

    strategy, fakes = _dp(monkeypatch, MixedPrecision("16-mixed", torch.float16, "cpu"))
    x, y = torch.randn(8, 4), torch.randn(8, 1)
    loss = strategy.step("training_step", (x, y), 0)
    seen = strategy._module.seen
    assert [(enabled, dtype) for enabled, dtype, _ in seen] == [(True, torch.float16)] * 2
    assert {thread for _, _, thread in seen} == fakes.threads and len(fakes.threads) == 2
    assert loss.shape == () and loss.requires_grad


def test_dp_averages_only_the_training_loss_and_gathers_other_outputs(monkeypatch: pytest.MonkeyPatch) -> None:
    from ember.precision import Precision

    strategy, _ = _dp(monkeypatch, Precision())
    x, y = torch.randn(8, 4), torch.randn(8, 1)
    loss = strategy.step("training_step", (x, y), 0)
    module = strategy._module
    expected = torch.nn.functional.mse_loss(module.layer(x), y)
    torch.testing.assert_close(loss, expected)  # equal shares: the mean of their losses
    assert module.trainer.run_metrics.names == ["share"]  # logged once, from the first share
    with torch.no_grad():
        predictions = strategy.step("predict_step", (x, y), 0)
    torch.testing.assert_close(predictions["per_sample"], module.layer(x).squeeze(1))
    assert predictions["column"].shape == (8, 1)
    assert predictions["count"].tolist() == [4, 4] and predictions["label"] == "dp"


# --------------------------------------------------------------------------- sharded strategies
@pytest.fixture
def _one_rank_group() -> Any:
    """A process group of this one process (for device meshes), closed afterwards if the test opened it."""
    import torch.distributed as dist

    opened = not dist.is_initialized()
    if opened:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    if opened:
        dist.destroy_process_group()


@pytest.mark.usefixtures("_one_rank_group")
def test_the_gradient_norm_is_reduced_on_the_device_of_the_group(monkeypatch: pytest.MonkeyPatch) -> None:
    """FSDP's cpu_offload keeps the gradient shards on the CPU, but an NCCL group reduces GPU tensors only."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard, distribute_tensor

    from ember.strategies import FSDPStrategy

    mesh = init_device_mesh("cpu", (1,))
    gradients = [distribute_tensor(torch.full((4, 3), 2.0), mesh, [Shard(0)]), torch.ones(2)]
    reduced_on: list[torch.device] = []

    def full_tensor(self: DTensor) -> torch.Tensor:
        reduced_on.append(self.to_local().device)
        return self.to_local()

    monkeypatch.setattr(DTensor, "full_tensor", full_tensor)
    strategy = FSDPStrategy()
    # The meta device stands in for the GPU of the group: a device that is not where the gradients are.
    monkeypatch.setattr(FSDPStrategy, "root_device", property(lambda self: torch.device("meta")))
    norm = strategy._total_norm(gradients)
    assert reduced_on == [torch.device("meta")] and norm.device == torch.device("meta")


def test_pipeline_evaluation_sends_the_last_stage_tensors_as_tensors_not_pickles(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A pickled GPU tensor is unpickled on the GPU it was on, the last stage's: not this rank's."""
    import torch.distributed as dist

    import ember
    from ember.strategies import PipelineStrategy

    sys.path.insert(0, SCRIPTS)
    import train_sharded as jobs

    class Predicting(jobs.Net):
        def predict_step(self, batch: Any, batch_idx: int, dataloader_idx: int = 0) -> Any:
            x, _ = batch
            return {"output": self(x), "samples": len(x)}

    pickled: list[torch.Tensor] = []
    broadcast: list[torch.device] = []
    broadcast_objects, broadcast_tensor = dist.broadcast_object_list, dist.broadcast

    def objects(holder: list[Any], *args: Any, **kwargs: Any) -> Any:
        apply_to_tensors(holder, lambda tensor: None if tensor.is_meta else pickled.append(tensor))
        return broadcast_objects(holder, *args, **kwargs)

    def tensor(sent: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        broadcast.append(sent.device)
        return broadcast_tensor(sent, *args, **kwargs)

    monkeypatch.setattr(dist, "broadcast_object_list", objects)
    monkeypatch.setattr(dist, "broadcast", tensor)
    loader = DataLoader(jobs.regression_data(16), batch_size=8)
    trainer = ember.Trainer(accelerator="cpu", strategy=PipelineStrategy(2, "GPipe"), logger=False,
                            enable_progress_bar=False, enable_model_summary=False)  # fmt: skip
    predictions = trainer.predict(Predicting(), loader)
    assert pickled == [] and broadcast == [torch.device("cpu")] * 2  # one output tensor per batch
    expected = jobs.Net()(next(iter(loader))[0])
    torch.testing.assert_close(predictions[0]["output"], expected)
    assert predictions[0]["samples"] == 8


# ------------------------------------------------------------------------------- ThroughputMonitor
TF32_THROUGH_THE_NEW_API = """
import torch
torch.cuda.get_device_name = lambda device=None: "NVIDIA A100-SXM4-80GB"
from ember.callbacks.throughput import peak_flops
cuda = torch.device("cuda", 0)
torch.backends.cuda.matmul.fp32_precision = "tf32"  # torch's new API; its old getter now raises
print(peak_flops(cuda, "32-true"), peak_flops(cuda, "32-true", convolutions=True))
torch.backends.cuda.matmul.fp32_precision = "ieee"
torch.backends.cudnn.conv.fp32_precision = "ieee"
print(peak_flops(cuda, "32-true"), peak_flops(cuda, "32-true", convolutions=True))
"""


def test_peak_flops_reads_tf32_set_through_torchs_fp32_precision_api() -> None:
    result = subprocess.run([sys.executable, "-c", TF32_THROUGH_THE_NEW_API], capture_output=True, text=True,
                            timeout=60)  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.split() == ["156000000000000.0"] * 2 + ["19500000000000.0"] * 2


@pytest.mark.usefixtures("_default_tf32")
def test_float32_convolutions_count_cudnns_tf32_peak(monkeypatch: pytest.MonkeyPatch) -> None:
    """cuDNN runs float32 convolutions on TF32 tensor cores by default, whatever the matmul precision."""
    from ember.callbacks.throughput import peak_flops, step_peak_flops

    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA A100-SXM4-80GB")
    cuda, aten = torch.device("cuda", 0), torch.ops.aten
    assert peak_flops(cuda, "32-true") == 19.5e12 and peak_flops(cuda, "32-true", convolutions=True) == 156e12
    flops = {aten.convolution: 3e9, aten.convolution_backward: 6e9, aten.mm: 1e9}
    # Each part at its own peak: 9 GFLOPs at 156 TFLOP/s and 1 GFLOP at 19.5 TFLOP/s take 0.109 ms at best.
    assert step_peak_flops(cuda, "32-true", flops) == pytest.approx(10e9 / (9e9 / 156e12 + 1e9 / 19.5e12))
    assert step_peak_flops(cuda, "bf16-mixed", flops) == 312e12
    torch.backends.cudnn.allow_tf32 = False
    assert step_peak_flops(cuda, "32-true", flops) == 19.5e12
    assert step_peak_flops(torch.device("cpu"), "32-true", flops) is None


@pytest.fixture
def _default_tf32() -> Any:
    yield
    torch.backends.cudnn.allow_tf32 = True


class _Convolutional(ember.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = torch.nn.Conv2d(1, 4, 3)
        self.head = torch.nn.Linear(4, 1)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        features = self.conv(x.view(-1, 1, 2, 2).repeat(1, 1, 2, 2)).mean((2, 3))
        return torch.nn.functional.mse_loss(self.head(features), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.01)


def test_mfu_is_measured_against_the_peak_of_the_counted_operations(monkeypatch: pytest.MonkeyPatch) -> None:
    from conftest import make_loader, quiet_trainer
    from test_speed import _Metrics
    from torch.utils.flop_counter import FlopCounterMode

    from ember.callbacks import ThroughputMonitor, throughput

    def peak(device: torch.device, precision: str, *, convolutions: bool = False) -> float:
        return 4e6 if convolutions else 1e6  # a device whose convolutions run 4x faster than its matmuls

    monkeypatch.setattr(throughput, "peak_flops", peak)
    logger, monitor = _Metrics(), ThroughputMonitor()
    trainer = quiet_trainer(max_epochs=1, logger=logger, log_every_n_steps=2, enable_checkpointing=False,
                            callbacks=[monitor])  # fmt: skip
    trainer.fit(_Convolutional(), make_loader(64, batch_size=8))
    with FlopCounterMode(display=False) as counter:
        _Convolutional().training_step(next(iter(make_loader(8))), 0).backward()
    flops = counter.get_flop_counts()["Global"]
    convolutions = sum(count for op, count in flops.items() if "convolution" in str(op))
    assert 0 < convolutions < sum(flops.values())
    expected = sum(flops.values()) / (convolutions / 4e6 + (sum(flops.values()) - convolutions) / 1e6)
    rows = logger.throughput()
    assert rows and all(row["throughput/tflops_per_sec"] * 1e12 / row["throughput/mfu"] == pytest.approx(expected)
                        for _, row in rows)  # fmt: skip


# ---------------------------------------------------------------------------------- 16-mixed
def _scaled_step(precision: Any, optimizer: torch.optim.Optimizer, layer: torch.nn.Module) -> int:
    """Backward, unscale and step as the loop does; the number of tensor values read on the host."""
    reads = []
    item = torch.Tensor.item

    def counted(tensor: torch.Tensor) -> Any:
        reads.append(tensor)
        return item(tensor)

    precision.backward(layer(torch.randn(8, 4)).pow(2).mean())
    precision.unscale_gradients(optimizer)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(torch.Tensor, "item", counted)
        precision.optimizer_step(optimizer)
    optimizer.zero_grad()
    return len(reads)


def test_float16_loss_scaling_syncs_per_step_only_with_an_optimizer_that_cannot_skip_on_the_device(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import warnings

    from ember.precision import MixedPrecision
    from ember.rank_zero import rank_zero_only

    monkeypatch.setattr(rank_zero_only, "rank", 0)
    layer = torch.nn.Linear(4, 1)
    fused = MixedPrecision("16-mixed", torch.float16, "cpu")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert _scaled_step(fused, torch.optim.SGD(layer.parameters(), lr=0.1, fused=True), layer) == 0

    plain, optimizer = MixedPrecision("16-mixed", torch.float16, "cpu"), torch.optim.SGD(layer.parameters(), lr=0.1)
    with pytest.warns(UserWarning, match=r"16-mixed.* with SGD: .*one host-device sync per step.*fused=True"):
        assert _scaled_step(plain, optimizer, layer) == 1  # GradScaler reads found_inf before stepping
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once per run
        _scaled_step(plain, optimizer, layer)
    monkeypatch.setattr(rank_zero_only, "rank", 1)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # rank zero says it
        _scaled_step(MixedPrecision("16-mixed", torch.float16, "cpu"), optimizer, layer)


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_float16_loss_scaling_agrees_across_ranks_when_every_gradient_is_sharded_alike(tmp_path: Any) -> None:
    """Why 16-mixed is accepted with FSDP and refused with tensor parallel (and pipelines, whose stages'
    gradients are ordinary tensors): GradScaler's overflow flag is all-reduced over the mesh of the first
    DTensor gradient, with its placements."""
    script = os.path.join(SCRIPTS, "scaler_dtensor.py")
    command = [sys.executable, "-m", "ember", "run", "--nproc-per-node", "2", script, "--out", str(tmp_path)]
    result = warm_processes.run(command, capture_output=True, text=True, timeout=100, cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    ranks = [json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in (0, 1)]
    assert [rank["fsdp"] for rank in ranks] == [{"stepped": False, "scale": 32768.0}] * 2  # both skip
    assert [rank["replicated-first"]["stepped"] for rank in ranks] == [True, False]  # the ranks part ways
    assert all("mixed torch.Tensor and DTensor" in rank["plain-and-sharded"]["error"] for rank in ranks)


def test_float16_mixed_precision_is_accepted_by_fsdp_and_refused_where_ranks_could_part_ways(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from conftest import Regressor, make_loader, quiet_trainer

    import ember.strategies.strategy
    from ember.precision import MixedPrecision
    from ember.strategies import FSDPStrategy, select_strategy

    # What a GPU gets for "16-mixed" (a CPU gets bf16-mixed instead): float16 autocast with a loss scaler.
    def float16(flag: Any, device: torch.device) -> MixedPrecision:
        return MixedPrecision("16-mixed", torch.float16, "cpu")

    monkeypatch.setattr(ember.strategies.strategy, "build_precision", float16)
    model = Regressor()
    initial = model.layer.weight.detach().clone()
    trainer = quiet_trainer(strategy="fsdp", precision="16-mixed", max_epochs=1, logger=False)
    trainer.fit(model, make_loader())
    weight = model.layer.weight.full_tensor().detach()
    assert weight.isfinite().all() and not torch.equal(weight, initial)
    assert 0 < trainer.strategy.precision.scaler.get_scale() < 65536.0  # overflowing steps were skipped
    for strategy in ("model_parallel", "pipeline"):
        with pytest.raises(ValueError, match=rf"precision='16-mixed' .* strategy='{strategy}' .*'bf16-mixed'"):
            quiet_trainer(strategy=strategy, precision="16-mixed")
    for name, value in (("is_available", lambda: True), ("device_count", lambda: 1)):
        monkeypatch.setattr(torch.cuda, name, value)
    with pytest.raises(ValueError, match=r"cpu_offload=True\) with precision='16-mixed'.*'bf16-mixed'"):
        select_strategy(accelerator="cuda", devices=1, num_nodes=1, strategy=FSDPStrategy(cpu_offload=True),
                        precision="16-mixed", sync_batchnorm=False)  # fmt: skip


# ------------------------------------------------------------------------------- on real GPUs
two_gpus = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")


@pytest.mark.cuda
@two_gpus
def test_dp_on_two_gpus_computes_in_bfloat16_and_gathers_per_sample_predictions() -> None:
    from conftest import Regressor, make_loader, quiet_trainer

    if not torch.cuda.is_bf16_supported(including_emulation=False):
        pytest.skip("this GPU has no bfloat16")

    class Recording(Regressor):
        def __init__(self) -> None:
            super().__init__()
            self.seen: list[tuple[bool, torch.dtype, torch.device]] = []  # shared by the replicas

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            x, _ = batch
            self.seen.append((torch.is_autocast_enabled("cuda"), torch.get_autocast_dtype("cuda"), x.device))
            assert self.trainer.global_step >= 0 and self.optimizers() is not None  # every replica has them
            return super().training_step(batch, batch_idx)

        def predict_step(self, batch: Any, batch_idx: int, dataloader_idx: int = 0) -> Any:
            x, _ = batch
            return {"per_sample": self(x).squeeze(1), "share": len(x)}

    model = Recording()
    trainer = quiet_trainer(accelerator="cuda", devices=2, strategy="dp", precision="bf16-mixed", max_epochs=1,
                            logger=False, enable_checkpointing=False)  # fmt: skip
    trainer.fit(model, make_loader(32, batch_size=8))
    assert {(enabled, dtype) for enabled, dtype, _ in model.seen} == {(True, torch.bfloat16)}
    assert {device for _, _, device in model.seen} == {torch.device("cuda", 0), torch.device("cuda", 1)}
    assert trainer.strategy.precision.scaler is None and trainer.global_step == 4
    assert torch.isfinite(trainer.callback_metrics["train_loss"])  # logged from the first share
    predictions = trainer.predict(model, make_loader(16, batch_size=8))
    assert [p["per_sample"].shape for p in predictions] == [(8,), (8,)]
    assert predictions[0]["share"].tolist() == [4, 4]


@pytest.mark.cuda
def test_a_dataset_that_yields_cuda_tensors_trains_and_cpu_batches_are_pinned() -> None:
    from conftest import Regressor, make_data, quiet_trainer

    x, y = make_data(32).tensors
    on_gpu = DataLoader(torch.utils.data.TensorDataset(x.cuda(), y.cuda()), batch_size=8)
    model = Regressor()
    quiet_trainer(accelerator="cuda", devices=1, max_epochs=1, logger=False).fit(model, on_gpu)
    assert model.layer.weight.isfinite().all()
    on_cpu = prepare_loader(DataLoader(make_data(32), batch_size=8), _OnAGPU(), train=False)  # type: ignore[arg-type]
    assert all(tensor.is_pinned() for tensor in next(iter(on_cpu)))


class _OnTheGPU:
    """Mixed into a module: asserts that every batch of every step is on the GPU."""

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        assert all(tensor.device.type == "cuda" for tensor in batch), [tensor.device for tensor in batch]
        return super().training_step(batch, batch_idx)  # type: ignore[misc]


@pytest.mark.cuda
def test_fsdp_with_cpu_offload_clips_by_the_norm_of_every_shard() -> None:
    from conftest import Regressor, make_loader, parameters_of, quiet_trainer

    from ember.strategies import FSDPStrategy

    class OnTheGPU(_OnTheGPU, Regressor):
        pass

    expected = Regressor()
    quiet_trainer(max_epochs=1, gradient_clip_val=0.1, logger=False).fit(expected, make_loader())
    model = OnTheGPU()  # the loader's CPU batches reach the GPU, where the offloaded parameters are gathered
    quiet_trainer(accelerator="cuda", devices=1, strategy=FSDPStrategy(cpu_offload=True), gradient_clip_val=0.1,
                  max_epochs=1, logger=False, enable_checkpointing=False).fit(model, make_loader())  # fmt: skip
    for got, want in zip(parameters_of(model), parameters_of(expected)):
        # One rank's shard is the whole parameter (gathering it would run an NCCL collective on CPU tensors).
        torch.testing.assert_close(got.to_local(), want, atol=1e-5, rtol=1e-5)


@pytest.mark.cuda
@pytest.mark.parametrize("strategy", ["fsdp", "model_parallel"])
def test_sharded_strategies_train_on_batches_moved_to_the_gpu_and_compile(strategy: str) -> None:
    from conftest import Regressor, make_loader, quiet_trainer

    class OnTheGPU(_OnTheGPU, Regressor):
        def configure_model(self, device_mesh: Any = None) -> None:
            """model_parallel asks for a layout: the one rank keeps the whole model."""

    model = OnTheGPU()
    trainer = quiet_trainer(accelerator="cuda", devices=1, strategy=strategy, compile={"backend": "eager"},
                            max_epochs=1, logger=False, enable_checkpointing=False)  # fmt: skip
    trainer.fit(model, make_loader())
    assert trainer.global_step == 8 and model._compiled_call_impl is not None
    assert torch.isfinite(trainer.fit_loop.last_loss)


@pytest.mark.cuda
def test_a_run_resumes_on_a_gpu_with_numpys_generator_in_the_checkpoint(tmp_path: Any) -> None:
    numpy = pytest.importorskip("numpy")
    from conftest import Regressor, make_loader, quiet_trainer

    first = quiet_trainer(accelerator="cuda", devices=1, max_epochs=1, logger=False, default_root_dir=str(tmp_path))
    first.fit(Regressor(), make_loader())
    saved = numpy.random.get_state()[1].copy()  # NumPy is imported: its generator's key is in the checkpoint
    first.save_checkpoint(tmp_path / "epoch1.ckpt")
    numpy.random.seed(1)
    second = quiet_trainer(accelerator="cuda", devices=1, max_epochs=2, logger=False,
                           default_root_dir=str(tmp_path / "resumed"))  # fmt: skip
    second.fit(Regressor(), make_loader(), ckpt_path=str(tmp_path / "epoch1.ckpt"))
    assert second.global_step == 16 and numpy.array_equal(numpy.random.get_state()[1], saved)


@pytest.mark.cuda
def test_a_background_checkpoint_of_a_gpu_run_is_copied_to_pinned_memory_and_resumes_exactly(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    from conftest import Regressor, make_loader, parameters_of, quiet_trainer

    from ember import checkpoint
    from ember.callbacks import ModelCheckpoint
    from ember.checkpoint.writer import AsyncWriter

    pinned: list[bool] = []
    snapshot = AsyncWriter.snapshot

    def watched(self: AsyncWriter, state: Any) -> dict[str, Any]:
        copied = snapshot(self, state)
        pinned.extend(tensor.is_pinned() for tensor in copied["state_dict"].values())
        return copied

    monkeypatch.setattr(AsyncWriter, "snapshot", watched)

    def fit(root: str, ckpt_path: str | None = None) -> tuple[ember.Trainer, Regressor]:
        every_four = ModelCheckpoint(every_n_train_steps=4, save_top_k=-1, save_last=True)
        trainer = quiet_trainer(accelerator="cuda", devices=1, max_epochs=2, async_checkpoint=True, logger=False,
                                default_root_dir=str(tmp_path / root), callbacks=[every_four])  # fmt: skip
        model = Regressor()
        trainer.fit(model, make_loader(), ckpt_path=ckpt_path)
        return trainer, model

    whole, model = fit("whole")
    assert pinned and all(pinned)  # the state was on the GPU: every copy went to pinned host memory
    last = checkpoint.load(os.path.join(whole.checkpoint_dir, "last.ckpt"))
    assert last["global_step"] == 16
    final = [p.cpu() for p in parameters_of(model)]
    assert all(torch.equal(saved, p) for saved, p in zip(last["state_dict"].values(), final, strict=True))
    resumed, model = fit("resumed", ckpt_path=os.path.join(whole.checkpoint_dir, "epoch=0-step=8.ckpt"))
    assert resumed.global_step == 16
    assert all(torch.equal(p.cpu(), q) for p, q in zip(parameters_of(model), final, strict=True))


@pytest.mark.cuda
@pytest.mark.slow
def test_cuda_graphs_with_a_forward_that_returns_the_loss_log_every_step() -> None:
    from conftest import Regressor, make_loader, quiet_trainer

    class LossInForward(Regressor):
        def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
            return torch.nn.functional.mse_loss(self.layer(x), y)

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            loss = self(*batch)
            self.log("train_loss", loss, on_step=True, on_epoch=True)
            return loss

    trainer = quiet_trainer(accelerator="cuda", devices=1, compile={"mode": "reduce-overhead"}, max_epochs=3,
                            log_every_n_steps=1, logger=False, enable_checkpointing=False)  # fmt: skip
    trainer.fit(LossInForward(), make_loader(64, batch_size=8, drop_last=True))
    assert trainer.strategy.reuses_outputs and trainer.global_step == 24
    assert all(torch.isfinite(value) for value in trainer.callback_metrics.values())


@pytest.mark.cuda
def test_predictions_come_back_in_cpu_memory() -> None:
    from conftest import Regressor, make_loader, quiet_trainer

    class Predictor(Regressor):
        def predict_step(self, batch: Any, batch_idx: int, dataloader_idx: int = 0) -> Any:
            return {"output": self(batch[0]), "on": str(batch[0].device)}

    predictions = quiet_trainer(accelerator="cuda", devices=1, logger=False).predict(Predictor(), make_loader(16))
    assert [p["on"] for p in predictions] == ["cuda:0"] * 2
    assert all(p["output"].device.type == "cpu" and p["output"].shape == (8, 1) for p in predictions)


@pytest.mark.cuda
def test_float16_mixed_precision_steps_a_fused_optimizer_without_a_host_sync(monkeypatch: pytest.MonkeyPatch) -> None:
    from conftest import Regressor, make_loader, quiet_trainer

    from ember.precision import MixedPrecision

    stepped = MixedPrecision.optimizer_step

    def without_syncs(self: MixedPrecision, optimizer: torch.optim.Optimizer, *args: Any, **kwargs: Any) -> Any:
        torch.cuda.set_sync_debug_mode("error")  # a synchronising CUDA call raises
        try:
            return stepped(self, optimizer, *args, **kwargs)
        finally:
            torch.cuda.set_sync_debug_mode("default")

    class Fused(Regressor):
        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.AdamW(self.parameters(), lr=0.01, fused=True)

    monkeypatch.setattr(MixedPrecision, "optimizer_step", without_syncs)
    trainer = quiet_trainer(accelerator="cuda", devices=1, precision="16-mixed", max_epochs=1, logger=False,
                            enable_checkpointing=False)  # fmt: skip
    trainer.fit(Fused(), make_loader())
    assert trainer.global_step == 8
    with pytest.raises(RuntimeError, match="synchroniz"):  # GradScaler reads the overflow flag of a plain one
        quiet_trainer(accelerator="cuda", devices=1, precision="16-mixed", max_steps=1, logger=False,
                      enable_checkpointing=False).fit(Regressor(), make_loader())  # fmt: skip


PIPELINE_ON_GPUS = """
import json, os, sys, torch
from torch.utils.data import DataLoader
sys.path.insert(0, {scripts!r})
import train_sharded as jobs
import ember
from ember.strategies import PipelineStrategy

class Predicting(jobs.Net):
    def predict_step(self, batch, batch_idx):
        x, _ = batch
        return self(x.to(self.device))  # the first stage's input on its GPU

trainer = ember.Trainer(accelerator="cuda", strategy=PipelineStrategy(2, "GPipe"), logger=False,
                        enable_progress_bar=False, enable_model_summary=False)
output = trainer.predict(Predicting(), DataLoader(jobs.regression_data(16), batch_size=8))[0]
with open(os.path.join({out!r}, f"rank{{trainer.global_rank}}.json"), "w") as file:
    json.dump({{"device": str(output.device), "output": output.tolist()}}, file)
"""


@pytest.mark.cuda
@two_gpus
@pytest.mark.timeout(180)
def test_pipeline_stages_on_two_gpus_each_get_the_output_on_their_own_gpu(tmp_path: Any) -> None:
    sys.path.insert(0, SCRIPTS)
    import train_sharded as jobs

    script = tmp_path / "pipeline_on_gpus.py"
    script.write_text(PIPELINE_ON_GPUS.format(scripts=SCRIPTS, out=str(tmp_path)))
    command = [sys.executable, "-m", "ember", "run", "--nproc-per-node", "2", str(script)]
    result = warm_processes.run(command, capture_output=True, text=True, timeout=170, cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    ranks = [json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in (0, 1)]
    assert [rank["device"] for rank in ranks] == ["cuda:0", "cuda:1"]
    expected = jobs.Net()(next(iter(DataLoader(jobs.regression_data(16), batch_size=8)))[0])
    for rank in ranks:
        torch.testing.assert_close(torch.tensor(rank["output"]), expected, atol=1e-5, rtol=1e-5)


THROUGHPUT_IN_FLOAT32 = """
import sys, torch
sys.path.insert(0, {tests!r})
from conftest import make_loader, quiet_trainer
from test_gpu_paths import _Convolutional
from test_speed import _Metrics
from ember.callbacks import ThroughputMonitor
from ember.callbacks.throughput import peak_flops

torch.backends.cuda.matmul.fp32_precision = "tf32"  # torch's new API: its old getter now raises
logger = _Metrics()
known = peak_flops(torch.device("cuda", 0), "32-true") is not None
trainer = quiet_trainer(accelerator="cuda", devices=1, max_epochs=1, logger=logger, log_every_n_steps=2,
                        enable_checkpointing=False, callbacks=[ThroughputMonitor(peak_flops=None if known else 1e14)])
trainer.fit(_Convolutional(), make_loader(256, batch_size=8))
print("mfu", *(row["throughput/mfu"] for _, row in logger.throughput()))
"""


@pytest.mark.cuda
@pytest.mark.timeout(120)
def test_throughput_monitor_in_float32_with_tf32_set_through_the_new_api_on_a_gpu(tmp_path: Any) -> None:
    tests = os.path.dirname(os.path.abspath(__file__))
    script = THROUGHPUT_IN_FLOAT32.format(tests=tests)
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=110, cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    mfu = [float(value) for value in result.stdout.split("mfu", 1)[1].split()]
    assert mfu and all(0 < value < 1 for value in mfu)


# ------------------------------------------------------------------------------ bench/gpu_check.sh
GPU_CHECK = os.path.join(os.path.dirname(SCRIPTS), "..", "bench", "gpu_check.sh")

FAKE_PYTHON = """#!{python}
# Answers bench/gpu_check.sh as a machine with two GPUs would, with the output formats of the real commands.
import sys
arguments = sys.argv[1:]
if arguments[0] == "-c":
    import os
    if "torchft" in arguments[1] and not os.environ.get("FAKE_TORCHFT"):
        sys.exit("ModuleNotFoundError: No module named 'torchft'")
    print(os.environ.get("FAKE_GPUS", "2") if "device_count" in arguments[1] else "Fake GPU - torch 9.9")
elif arguments[:2] == ["-m", "pytest"]:
    print("....s" + chr(10) + "12 passed, 3 skipped, 40 deselected in 4.56s")
elif arguments[0] == "bench/gpt.py":
    import os
    print("FLOPs per token (forward + backward, torch.utils.flop_counter): 8.5e+08")
    print("mode                   hand-written tok/s    MFU  Ember tok/s    MFU Ember/hand")
    for label, hand, ember in (("fp32 (TF32 matmuls)", 50000, 49500), ("bf16-mixed + compile", 300000, 297000)):
        print(f"{{label:<22}} {{hand:>18.0f}} {{'40.1%':>6}} {{ember:>12.0f}} {{'39.7%':>6}} {{ember / hand:>9.3f}}x")
        if os.environ.get("GPT_FAILS"):
            sys.exit("torch._dynamo.exc.BackendCompilerFailed")  # the second mode fails
elif arguments[0] == "bench/memory.py":
    print("| Strategy | parameters + optimizer state per rank | peak allocated per rank |")
    print("| --- | --- | --- |")
    print("| DDP | 768 MiB | 1100 MiB |")
    print("| FSDP (a unit per block) | 384 MiB | 600 MiB |")
elif "bench/gpu_smoke.py" in arguments:  # the run last; the figure says how the script was started
    ok = arguments[-1] != "manual"
    print(f"smoke: {{arguments[-1]}} {{'ok' if ok else 'FAILED'}}: loss 0.700 -> 0.020 ({{' '.join(arguments)}})")
    sys.exit(0 if ok else 1)
"""


def _gpu_check_environment(directory: Any) -> dict[str, str]:
    """bench/gpu_check.sh run by this interpreter (PYTHON), whatever python3 PATH finds first: here one that
    fails, put first on PATH, as the python3 of a system without torch is when the tests run from a virtual
    environment that is not activated."""
    decoy = directory / "python3"
    decoy.write_text("#!/bin/sh\necho 'not the python3 to use' >&2\nexit 1\n")
    decoy.chmod(0o755)
    return {**os.environ, "PATH": f"{directory}:{os.environ['PATH']}", "PYTHON": sys.executable}


def test_gpu_check_says_it_skips_on_a_machine_without_a_gpu(tmp_path: Any) -> None:
    if torch.cuda.is_available():
        pytest.skip("checks the machine without a GPU")
    env = _gpu_check_environment(tmp_path)
    result = subprocess.run(["bash", GPU_CHECK], capture_output=True, text=True, timeout=120, env=env)
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.strip().endswith(f"skipped: no GPU (torch.cuda.device_count() is 0 with {sys.executable})")
    missing = subprocess.run(["bash", GPU_CHECK], capture_output=True, text=True, timeout=60,
                             env={**env, "PYTHON": "/nonexistent/python"})  # fmt: skip
    assert missing.returncode == 1 and "cannot import torch with /nonexistent/python" in missing.stdout


def test_gpu_check_tabulates_each_item_and_fails_when_one_fails(tmp_path: Any) -> None:
    fake = tmp_path / "python"
    fake.write_text(FAKE_PYTHON.format(python=sys.executable))
    fake.chmod(0o755)
    env = {**os.environ, "PYTHON": str(fake), "TMPDIR": str(tmp_path)}
    result = subprocess.run(["bash", GPU_CHECK], capture_output=True, text=True, timeout=120, env=env)
    assert result.returncode == 1, result.stdout + result.stderr
    table = result.stdout[result.stdout.index("gpu_check on 2 GPU(s): Fake GPU - torch 9.9") :].splitlines()
    rows = {line[:34].strip(): line[34:].split(maxsplit=1) for line in table[3:-1]}
    assert rows == {
        "cuda-tests": ["pass", "12 passed, 3 skipped, 40 deselected in 4.56s"],
        "gpt fp32 (TF32 matmuls)": ["pass", "Ember 49500 tok/s (MFU 39.7%), hand-written 50000 tok/s (MFU 40.1%): "
                                            "Ember/hand 0.990x"],
        "gpt bf16-mixed + compile": ["pass", "Ember 297000 tok/s (MFU 39.7%), hand-written 300000 tok/s (MFU 40.1%): "
                                             "Ember/hand 0.990x"],
        "memory": ["pass", "DDP: 768 MiB held, 1100 MiB peak; FSDP (a unit per block): 384 MiB held, 600 MiB peak"],
        **{f"smoke-{r}": ["pass", f"loss 0.700 -> 0.020 (bench/gpu_smoke.py {r})"] for r in ("ddp", "fsdp", "dp")},
        "smoke-manual": ["FAIL", "loss 0.700 -> 0.020 (bench/gpu_smoke.py manual)"],
        "smoke-ft": ["skipped", "torchft is not installed (pip install -e '.[ft]')"],
    }  # fmt: skip
    assert "===== smoke-manual failed (exit status 1)" in result.stdout
    assert table[-1].startswith(f"logs: {tmp_path}")

    # A mode of the GPT benchmark fails: the modes measured before it keep their rows.
    result = subprocess.run(["bash", GPU_CHECK], capture_output=True, text=True, timeout=120,
                            env={**env, "GPT_FAILS": "1"})  # fmt: skip
    gpt = {line[:34].strip(): line[34:].split(maxsplit=1) for line in result.stdout.splitlines() if line[:3] == "gpt"}
    assert gpt == {"gpt fp32 (TF32 matmuls)": rows["gpt fp32 (TF32 matmuls)"], "gpt": ["FAIL", "1 of 3 modes measured"]}
    assert "===== gpt failed (exit status 1)" in result.stdout and "BackendCompilerFailed" in result.stdout

    # One GPU: two processes share it, started by `ember run` and joined over Gloo; what needs two GPUs is skipped.
    # With torchft installed, fault tolerance has a smoke run too.
    result = subprocess.run(["bash", GPU_CHECK], capture_output=True, text=True, timeout=120,
                            env={**env, "FAKE_GPUS": "1", "FAKE_TORCHFT": "1"})  # fmt: skip
    assert result.returncode == 1, result.stdout
    table = result.stdout[result.stdout.index("gpu_check on 1 GPU(s)") :].splitlines()
    rows = {line[:34].strip(): line[34:].split(maxsplit=1) for line in table[3:-1]}
    shared = "-m ember run --nproc-per-node 2 bench/gpu_smoke.py --backend gloo"
    assert {name: row for name, row in rows.items() if name.startswith(("smoke", "memory"))} == {
        "memory": ["skipped", "needs two GPUs (two processes)"],
        "smoke-dp": ["skipped", "needs two GPUs (one process drives both)"],
        **{f"smoke-{run}": ["pass", f"loss 0.700 -> 0.020 ({shared} {run})"] for run in ("ddp", "fsdp")},
        "smoke-manual": ["FAIL", f"loss 0.700 -> 0.020 ({shared} manual)"],
        "smoke-ft": ["pass", f"loss 0.700 -> 0.020 (-m ember run --replica-groups 2 bench/gpu_smoke.py --backend gloo "
                             f"--out {table[-1].removeprefix('logs: ')}/ft ft)"],
    }  # fmt: skip


@pytest.mark.slow
def test_the_smoke_run_of_two_processes_sharing_one_device_trains_over_gloo() -> None:
    # gpu_check.sh's command on a machine with one GPU, on CPU here: the launcher starts both processes.
    smoke = os.path.join(os.path.dirname(GPU_CHECK), "gpu_smoke.py")
    command = [sys.executable, "-m", "ember", "run", "--nproc-per-node", "2", smoke, "--backend", "gloo", "fsdp"]
    result = warm_processes.run([*command, "--accelerator", "cpu"], capture_output=True, text=True, timeout=110)
    assert result.returncode == 0, result.stdout + result.stderr[-3000:]
    assert "smoke: fsdp ok: " in result.stdout and "2 process(es) on cpu over gloo" in result.stdout


def test_gpu_check_fails_where_nvidia_smi_lists_gpus_that_torch_does_not_see(tmp_path: Any) -> None:
    if torch.cuda.is_available():
        pytest.skip("checks a torch that sees no GPU")
    smi = tmp_path / "nvidia-smi"
    smi.write_text("#!/bin/sh\necho 'GPU 0: NVIDIA H100 80GB HBM3 (UUID: GPU-0)'\n")
    smi.chmod(0o755)
    env = _gpu_check_environment(tmp_path)  # on PATH: the nvidia-smi above, and a python3 not to use
    result = subprocess.run(["bash", GPU_CHECK], capture_output=True, text=True, timeout=60, env=env)
    assert result.returncode == 1, result.stdout + result.stderr
    assert f"nvidia-smi lists 1 GPU(s), but torch {torch.__version__} (CUDA None)" in result.stdout
