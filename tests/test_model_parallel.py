"""Models bigger than one device: FSDP, tensor and pipeline parallel, sharded checkpoints, manual
placement and meta-device initialisation.

The multi-process jobs (tests/scripts/train_sharded.py) run once, in two processes with Gloo, and
each test checks its part against one process training on the same data.
"""

from __future__ import annotations

import os
import pickle
import sys
from typing import Any

import pytest
import torch
import warm_processes
from conftest import Regressor, built_once, make_loader, quiet_trainer
from test_distributed import _run
from torch import nn
from torch.utils.data import DataLoader

import ember
from ember import checkpoint as checkpoint_io
from ember.callbacks import Callback
from ember.strategies import FSDPStrategy, ModelParallelStrategy, PipelineStrategy

SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "scripts", "train_sharded.py")
sys.path.insert(0, os.path.dirname(SCRIPT))
import train_sharded as jobs  # noqa: E402


@pytest.fixture
def sharded_run(tmp_path_factory: pytest.TempPathFactory) -> str:
    def build(out: str) -> None:
        result = _run([sys.executable, "-m", "ember", "run", "--nproc-per-node", "2", SCRIPT, "--out", out], out, 240)
        assert result.returncode == 0, result.stderr[-4000:]

    return built_once(tmp_path_factory, "sharded", build)


def _ranks(out: str, job: str) -> list[dict[str, Any]]:
    return [torch.load(os.path.join(out, f"{job}-rank{rank}.pt")) for rank in (0, 1)]


def _one_process(module: ember.Module, loader: DataLoader, **flags: Any) -> dict[str, torch.Tensor]:
    quiet_trainer(logger=False, enable_checkpointing=False, **flags).fit(module, loader)
    return {name: parameter.detach() for name, parameter in module.named_parameters()}


def _assert_close(got: dict[str, torch.Tensor], expected: dict[str, torch.Tensor], tolerance: float = 1e-5) -> None:
    assert got.keys() <= expected.keys() and got
    for name, value in got.items():
        assert (value - expected[name]).abs().max() < tolerance, name


def _regression(batch_size: int) -> DataLoader:
    return DataLoader(jobs.regression_data(), batch_size=batch_size)


FSDP_FLAGS = dict(accumulate_grad_batches=2, gradient_clip_val=0.3)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_fsdp_equals_ddp_with_half_the_state_per_rank(sharded_run: str) -> None:
    for result in _ranks(sharded_run, "fsdp"):
        assert result["shards_are_dtensors"]
        _assert_close(result["fsdp"], result["ddp"], tolerance=1e-5)
        assert 0.45 < result["fsdp_bytes"] / result["ddp_bytes"] < 0.55  # parameters + optimizer state


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_sharded_checkpoints_resume_reshard_and_consolidate(sharded_run: str, tmp_path: Any) -> None:
    directory = os.path.join(sharded_run, "fsdp")
    assert sorted(os.listdir(directory)) == ["epoch=1-step=4.ckpt", "last.ckpt"]  # save_top_k=1 removed epoch 0
    best, last = (os.path.join(directory, name) for name in ("epoch=1-step=4.ckpt", "last.ckpt"))
    assert sorted(os.listdir(last)) == [".metadata", "__0_0.distcp", "__1_0.distcp", "trainer_state.pt"]
    assert os.path.samefile(os.path.join(best, "__1_0.distcp"), os.path.join(last, "__1_0.distcp"))  # hard links

    # Two ranks resumed a module built on the meta device: as if one process had trained 3 epochs.
    expected = _one_process(jobs.Net(), _regression(16), max_epochs=3, **FSDP_FLAGS)
    for result in _ranks(sharded_run, "resume"):
        _assert_close(result["resumed"], expected)
        # Written in the background (torch.distributed.checkpoint's async_save), resumed bit for bit alike.
        assert all(torch.equal(result["resumed_async"][name], value) for name, value in result["resumed"].items())
    assert sorted(os.listdir(os.path.join(sharded_run, "fsdp-async"))) == ["epoch=1-step=4.ckpt", "last.ckpt"]

    # One rank resumes from the two ranks' shards.
    resharded = jobs.Net()
    quiet_trainer(strategy=FSDPStrategy(), max_epochs=3, logger=False, enable_checkpointing=False, **FSDP_FLAGS).fit(
        resharded, _regression(16), ckpt_path=last
    )
    _assert_close(jobs.full_parameters(resharded), expected)

    # An ordinary file made by the command line resumes too, and loads into a module.
    consolidated = str(tmp_path / "model.ckpt")
    command = [sys.executable, "-m", "ember", "checkpoint", "consolidate", last, consolidated]
    result = warm_processes.run(command, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    state = checkpoint_io.load(consolidated)
    assert state["optimizer_states"][0]["param_groups"][0]["lr"] == 0.05
    assert sorted(state["optimizer_states"][0]["state"]) == list(range(12))  # numbered as Optimizer.state_dict() does
    for strategy in ("auto", "fsdp", "pipeline"):  # an ordinary file starts a sharded run too
        model = jobs.Net()
        quiet_trainer(strategy=strategy, max_epochs=3, logger=False, enable_checkpointing=False, **FSDP_FLAGS).fit(
            model, _regression(16), ckpt_path=consolidated
        )
        _assert_close(jobs.full_parameters(model), expected)
    loaded = jobs.Net.load_from_checkpoint(last)  # a directory loads like a file
    _assert_close(dict(loaded.named_parameters()), state["state_dict"], tolerance=1e-12)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_tensor_parallel_equals_one_process(sharded_run: str) -> None:
    loader = DataLoader(jobs.token_data(), batch_size=8)
    expected = _one_process(jobs.TinyLM(), loader, max_epochs=2, gradient_clip_val=0.5)
    for result in _ranks(sharded_run, "tensor"):
        _assert_close(result["parameters"], expected)
        assert result["parameters"].keys() == expected.keys()
        assert 0 < result["dtensors"] < len(expected)  # the layer norms stay whole
        assert "tensor_parallel_size=2 does not divide the 33 rows of tok_embeddings.weight" in result["odd_error"]


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_pipeline_equals_one_process_with_the_same_batch(sharded_run: str) -> None:
    module = jobs.Net()
    trainer = quiet_trainer(max_epochs=2, gradient_clip_val=0.3, logger=False, enable_checkpointing=False)
    val = DataLoader(jobs.regression_data(16), batch_size=8)
    trainer.fit(module, _regression(8), val)
    expected = {name: parameter.detach() for name, parameter in module.named_parameters()}
    first, last = _ranks(sharded_run, "pipeline")
    assert list(first["parameters"]) == ["embed.weight", "embed.bias", *(f"layers.{i}.linear.{p}" for i in (0, 1)
                                                                          for p in ("weight", "bias"))]  # fmt: skip
    assert first["parameters"].keys() | last["parameters"].keys() == expected.keys()
    for stage in (first, last):
        _assert_close(stage["parameters"], expected)
        # every stage shows the last stage's loss, and validation sees the whole pipeline's output
        assert stage["last_loss"] == pytest.approx(float(trainer.fit_loop.last_loss), abs=1e-6)
        assert stage["val_loss"] == pytest.approx(float(trainer.callback_metrics["val_loss"]), abs=1e-6)
    state = checkpoint_io.load(first["last"])
    _assert_close({**first["parameters"], **last["parameters"]}, state["state_dict"], tolerance=1e-12)
    assert state["optimizer_states"][0]["param_groups"][0]["params"] == list(range(12))


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_two_dimensional_meshes_on_four_processes(tmp_path: Any) -> None:
    """Tensor parallel rows sharded over "data", and pipelines of FSDP-sharded stages: 2 x 2 each."""
    out = str(tmp_path)
    result = _run([sys.executable, "-m", "ember", "run", "--nproc-per-node", "4", SCRIPT, "--out", out], out, 200)
    assert result.returncode == 0, result.stderr[-4000:]
    tensor = _one_process(jobs.TinyLM(), DataLoader(jobs.token_data(), batch_size=8), max_epochs=1)
    pipeline = _one_process(jobs.Net(), _regression(16), max_epochs=1)
    for rank in range(4):
        got = torch.load(os.path.join(out, f"2d-tensor-rank{rank}.pt"))
        _assert_close(got["parameters"], tensor)
        assert "(Shard(dim=0), Shard(dim=1))" in got["placements"]  # sharded over both dimensions
        got = torch.load(os.path.join(out, f"2d-pipeline-rank{rank}.pt"))
        _assert_close(got["parameters"], pipeline)
        assert ("embed.weight" in got["parameters"]) == (rank < 2)  # ranks 0 and 1 run the first stage


# ------------------------------------------------------------------------------ one process
def test_a_module_built_on_the_meta_device_is_allocated_and_initialised() -> None:
    with torch.device("meta"):
        model = Regressor()
    quiet_trainer(max_epochs=1, logger=False, enable_checkpointing=False).fit(model, make_loader(16))
    assert all(not p.is_meta and torch.isfinite(p).all() for p in model.parameters())

    class Scale(nn.Module):  # owns a parameter but cannot initialise it
        def __init__(self) -> None:
            super().__init__()
            self.gain = nn.Parameter(torch.ones(1))

    with torch.device("meta"):
        model = Regressor()
        model.scale = Scale()
    with pytest.raises(TypeError, match=r"\['scale'\] define no reset_parameters\(\)"):
        quiet_trainer(max_epochs=1, logger=False).fit(model, make_loader(16))


class _Split(ember.Module):
    """Layers on two devices; predict_step reports where its batch arrived."""

    def __init__(self, first: str, second: str) -> None:
        super().__init__()
        self.encoder = nn.Linear(4, 4, device=first)
        self.decoder = nn.Linear(4, 1, device=second)

    def predict_step(self, batch: Any, batch_idx: int) -> torch.device:
        return batch[0].device


def test_layers_placed_by_hand_stay_and_batches_go_to_the_input_device() -> None:
    model = _Split("cpu", "meta")
    assert quiet_trainer(logger=False).predict(model, make_loader(16)) == [torch.device("cpu")] * 2
    assert model.encoder.weight.device.type == "cpu" and model.decoder.weight.is_meta
    model = _Split("cpu", "meta")
    model.input_device = "meta"
    assert quiet_trainer(logger=False).predict(model, make_loader(16)) == [torch.device("meta")] * 2


@pytest.mark.cuda
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_encoder_and_decoder_on_two_gpus_train_where_they_are() -> None:
    class TwoGPUs(Regressor):
        # Batches go to the first parameter's device unless told: Regressor registered `layer` first, and
        # assigning it again below keeps its place ahead of `encoder`, so that would be cuda:1.
        input_device = "cuda:0"

        def __init__(self) -> None:
            super().__init__()
            self.encoder = nn.Linear(4, 8).to("cuda:0")
            self.layer = nn.Linear(8, 1).to("cuda:1")

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.layer(self.encoder(x).to("cuda:1"))

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            x, y = batch
            return nn.functional.mse_loss(self(x), y.to("cuda:1"))

    model = TwoGPUs()
    quiet_trainer(accelerator="cuda", devices=1, max_epochs=2, logger=False).fit(model, make_loader(32))
    assert model.encoder.weight.device == torch.device("cuda:0") and model.layer.weight.device == torch.device("cuda:1")


class _Pipelined(jobs.Net):
    def __init__(self, **overrides: Any) -> None:
        super().__init__()
        for name, value in overrides.items():
            setattr(self, name, value)


def _pipeline_fit(model: ember.Module, loader: Any = None, **options: Any) -> None:
    strategy = PipelineStrategy(2, "GPipe", **options)
    quiet_trainer(strategy=strategy, max_epochs=1, logger=False, enable_checkpointing=False).fit(
        model, loader or _regression(8)
    )


@pytest.mark.parametrize(
    ("model", "options", "loader", "error", "message"),
    [
        (_Pipelined(automatic_optimization=False), {}, None, ValueError, r"manual optimization .* cannot work"),
        (Regressor(), {}, None, TypeError, r"Regressor.pipeline_loss\(output, target\), which it does not define"),
        (_Pipelined(), {"split_fn": lambda m, i, n: ["nothing"]}, None, ValueError,
         r"split_fn returned 'nothing', which is not a submodule of _Pipelined"),
        (_Pipelined(gain=nn.Parameter(torch.ones(1))), {}, None, ValueError,
         r"_Pipelined \(the module\) holds parameters itself \(\['gain'\]\)"),
        (_Pipelined(), {}, _regression(5), ValueError, r"a batch of 5 samples cannot be cut into n_microbatches=2"),
        (_Pipelined(), {}, [{"x": torch.ones(8, 4), "y": torch.ones(8, 1)}], ValueError,
         r"strategy='pipeline' takes batches of \(inputs, target\); got a dict"),
    ],
)  # fmt: skip
def test_pipeline_refuses_what_it_cannot_run(
    model: ember.Module, options: dict[str, Any], loader: Any, error: type[Exception], message: str
) -> None:
    with pytest.raises(error, match=message):
        _pipeline_fit(model, loader, **options)


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda: ModelParallelStrategy(3, 1), r"ModelParallelStrategy\(data_parallel_size=3, tensor_parallel_size=1\) "
         r"needs 3 x 1 = 3 processes, but the run has 2"),
        (lambda: ModelParallelStrategy("auto", 0), r"tensor_parallel_size=0\): use 'auto' or a positive int"),
        (lambda: PipelineStrategy(schedule="zigzag"), r"schedule='zigzag'\): choose one of \('1F1B', 'GPipe'\)"),
        (lambda: PipelineStrategy(0), r"n_microbatches=0\): use a positive int"),
        (lambda: PipelineStrategy(1), r"n_microbatches=1, schedule='1F1B'\) needs at least one micro-batch per stage"),
        (lambda: PipelineStrategy(split_points=["a", "b"]), r"makes 3 stages, but the run has 2"),
        (lambda: PipelineStrategy(data_parallel_size=3), r"data_parallel_size=3\) does not divide the 2 processes"),
        (lambda: PipelineStrategy(split_points=["a"], split_fn=lambda m, i, n: []), r"split_points or split_fn"),
        (lambda: FSDPStrategy(auto_wrap_policy="Block"), r"auto_wrap_policy='Block'\): give a set of nn.Module"),
        (lambda: FSDPStrategy(cpu_offload=True), r"cpu_offload=True\) keeps the model's state in CPU memory between "
         r"GPU computations; on accelerator='cpu'"),
        (lambda: FSDPStrategy(reshard_after_forward=0), r"reshard_after_forward=0\): use True, False or a group"),
    ],
)  # fmt: skip
def test_layouts_that_cannot_work_are_refused_before_any_process_starts(make: Any, message: str) -> None:
    with pytest.raises((ValueError, TypeError), match=message):
        ember.Trainer(accelerator="cpu", devices=2, strategy=make(), logger=False)


def test_sync_batchnorm_is_refused_where_it_would_be_ignored() -> None:
    for strategy in ("model_parallel", "pipeline"):
        with pytest.raises(ValueError, match=rf"sync_batchnorm=True is not supported with strategy='{strategy}'"):
            ember.Trainer(accelerator="cpu", devices=2, strategy=strategy, sync_batchnorm=True)


class _Losses(Callback):
    def __init__(self) -> None:
        self.losses: list[float] = []

    def on_train_batch_end(self, trainer: ember.Trainer, module: ember.Module, outputs: Any, *args: Any) -> None:
        self.losses.append(float(outputs["loss"]))


def test_pipeline_accumulates_gradients_like_the_other_strategies() -> None:
    """Backpropagating the step's loss runs the schedule, scaled by 1/window like any loss."""
    expected = _one_process(jobs.Net(), _regression(16), max_epochs=1)
    model, recorder = jobs.Net(), _Losses()
    quiet_trainer(strategy=PipelineStrategy(2), accumulate_grad_batches=2, max_epochs=1, logger=False,
                  enable_checkpointing=False, callbacks=[recorder]).fit(model, _regression(8))  # fmt: skip
    _assert_close(dict(model.named_parameters()), expected)
    x, y = next(iter(_regression(8)))
    loss = float(nn.functional.mse_loss(jobs.Net()(x), y).detach())
    assert recorder.losses[0] == pytest.approx(loss / 2, abs=1e-6)  # the hooks' loss, divided as Lightning's is


@pytest.mark.parametrize(
    "options",
    [
        {},
        {"accumulate_full_gradients": True, "reshard_after_forward": False},
        pytest.param({"cpu_offload": True}, marks=pytest.mark.cuda),
    ],
)
def test_fsdp_accumulates_into_the_shards_unless_asked(options: dict[str, Any]) -> None:
    class Probe(Callback):
        def on_train_batch_end(self, trainer: ember.Trainer, module: ember.Module, *args: Any) -> None:
            if trainer.global_step == 0:  # a micro-batch that did not step
                self.sharded_gradients = [p.grad is not None for p in module.parameters()]

    expected = _one_process(jobs.Net(), _regression(16), max_epochs=1)
    model, probe = jobs.Net(), Probe()
    strategy = FSDPStrategy(**options)
    accelerator = "cuda" if options.get("cpu_offload") else "cpu"
    quiet_trainer(accelerator=accelerator, devices=1, strategy=strategy, accumulate_grad_batches=2, max_epochs=1,
                  logger=False, enable_checkpointing=False, callbacks=[probe]).fit(model, _regression(8))  # fmt: skip
    _assert_close({name: value.cpu() for name, value in jobs.full_parameters(model).items()}, expected)
    full_gradients = options.get("accumulate_full_gradients", False)
    assert probe.sharded_gradients == [not full_gradients] * 12  # full ones wait, unsharded, for the step


def test_fsdp_computes_in_bfloat16_and_keeps_float32_shards_with_bf16_mixed() -> None:
    model, seen = jobs.Net(), []
    model.head.register_forward_pre_hook(lambda module, args: seen.append((module.weight.dtype, args[0].dtype)))
    trainer = quiet_trainer(strategy="fsdp", precision="bf16-mixed", max_epochs=1, logger=False)
    trainer.fit(model, _regression(8))
    assert set(seen) == {(torch.bfloat16, torch.bfloat16)}
    assert {p.dtype for p in model.parameters()} == {torch.float32}
    assert torch.isfinite(trainer.fit_loop.last_loss)


def test_fsdp_recomputes_the_activations_of_checkpointed_blocks() -> None:
    model, calls = jobs.Net(), []
    model.layers[0].linear.register_forward_hook(lambda *args: calls.append(torch.is_grad_enabled()))
    strategy = FSDPStrategy(auto_wrap_policy={jobs.Block}, activation_checkpointing_policy={jobs.Block})
    quiet_trainer(strategy=strategy, max_epochs=1, limit_train_batches=1, logger=False).fit(model, _regression(8))
    assert len(calls) == 2  # the forward, and its recomputation in the backward


@pytest.mark.parametrize("strategy", ["fsdp", "pipeline", "model_parallel"])
def test_sharded_strategies_refuse_modules_wrapped_for_data_parallel(strategy: str) -> None:
    model = _Pipelined()
    model.layers[1] = nn.DataParallel(model.layers[1])
    with pytest.raises(ValueError, match=rf"strategy='{strategy}' cannot lay out .* wrappers \(\['layers.1'\]\)"):
        quiet_trainer(strategy=strategy, max_epochs=1, logger=False).fit(model, _regression(8))


def test_model_parallel_needs_configure_model() -> None:
    with pytest.raises(TypeError, match=r"Regressor.configure_model\(device_mesh\), which it does not define"):
        quiet_trainer(strategy="model_parallel", max_epochs=1, logger=False).fit(Regressor(), make_loader(16))


@pytest.mark.cuda
def test_only_fsdp_takes_float16_mixed_precision() -> None:
    assert ember.Trainer(accelerator="cuda", devices=1, strategy="fsdp", precision="16-mixed").precision == "16-mixed"
    for strategy in ("model_parallel", "pipeline"):
        with pytest.raises(ValueError, match=r"precision='16-mixed' skips the steps whose gradients overflowed"):
            ember.Trainer(accelerator="cuda", devices=1, strategy=strategy, precision="16-mixed")


def _sharded_checkpoint(tmp_path: Any) -> str:
    """A sharded checkpoint written by one process."""
    trainer = quiet_trainer(strategy="fsdp", max_epochs=1, logger=False, enable_checkpointing=False)
    trainer.fit(Regressor(), make_loader(16))
    path = str(tmp_path / "sharded.ckpt")
    trainer.save_checkpoint(path)
    return path


class _Payload:
    def __reduce__(self) -> Any:
        return (os.system, ("echo ran > pwned",))


def test_sharded_checkpoints_run_no_code_from_their_files(tmp_path: Any) -> None:
    path = _sharded_checkpoint(tmp_path)
    state_file = os.path.join(path, "trainer_state.pt")
    state = torch.load(state_file)
    torch.save({**state, "extra": _Payload()}, state_file)
    with pytest.raises(checkpoint_io.CheckpointError, match="holds pickled objects other than tensors"):
        checkpoint_io.load(path)
    command = [sys.executable, "-m", "ember", "checkpoint", "consolidate", path, str(tmp_path / "out.ckpt")]
    refused = warm_processes.run(command, capture_output=True, text=True, timeout=60)
    assert refused.returncode == 1 and "--trust-pickles" in refused.stderr
    torch.save(state, state_file)
    with open(os.path.join(path, ".metadata"), "wb") as file:
        pickle.dump(_Payload(), file)
    with pytest.raises(pickle.UnpicklingError, match=r"references posix.system, which is refused"):
        checkpoint_io.load(path)
    assert not os.path.exists("pwned")
    not_sharded = warm_processes.run(
        [*command[:-2], str(tmp_path), "x.ckpt"], capture_output=True, text=True, timeout=60
    )
    assert not_sharded.returncode == 2 and "is not a sharded checkpoint" in not_sharded.stderr


def test_checkpoint_command_help() -> None:
    command = [sys.executable, "-m", "ember", "checkpoint", "consolidate", "--help"]
    result = warm_processes.run(command, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0 and "DIR" in result.stdout and "OUT" in result.stdout
    assert "Trainer.fit(ckpt_path=OUT)" in result.stdout
