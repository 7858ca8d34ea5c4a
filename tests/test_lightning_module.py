"""The module, its hooks and hyperparameters, and the Trainer's flags, with the meanings Lightning gives them."""

from __future__ import annotations

import importlib
import os
from argparse import Namespace
from typing import Any

import pytest
import torch
from conftest import Regressor, make_loader, quiet_trainer
from torch.utils.data import DataLoader

import ember
from ember.callbacks import Callback
from ember.demos import BoringDataModule, BoringModel
from ember.exceptions import MisconfigurationException, PossibleUserWarning
from ember.hparams import HyperparametersMixin
from ember.lightning_compat.hook import table_of
from ember.loggers import CSVLogger


def _served(fullname: str, name: str) -> Any:
    """The object Ember serves as Lightning's ``fullname.name``."""
    module, _, attribute = str(table_of(fullname)[name]).partition(":")
    return getattr(importlib.import_module(module), attribute)


# --------------------------------------------------------------------------- hyperparameters
class _Configured(BoringModel):
    """Takes its hyperparameters as one config object."""

    def __init__(self, config: Any) -> None:
        super().__init__()
        self.save_hyperparameters(config)


def test_a_config_given_whole_is_given_back_whole() -> None:
    model = _Configured(Namespace(lr=0.07, note="x"))
    assert model.hparams == {"lr": 0.07, "note": "x"}
    trainer = quiet_trainer(max_steps=1, logger=False)
    trainer.fit(model)
    path = trainer.checkpoint_callback.best_model_path
    checkpoint = torch.load(path, weights_only=True)
    assert checkpoint[ember.Module.CHECKPOINT_HYPER_PARAMS_KEY]["note"] == "x"
    assert checkpoint[ember.Module.CHECKPOINT_HYPER_PARAMS_NAME] == "config"
    loaded = _Configured.load_from_checkpoint(path)
    assert loaded.hparams.note == "x" and loaded.hparams.lr == 0.07


def test_older_lightning_checkpoints_give_their_hyperparameters() -> None:
    torch.save({"state_dict": Regressor().state_dict(), "module_arguments": {"lr": 0.3}}, "old.ckpt")
    assert Regressor.load_from_checkpoint("old.ckpt").hparams.lr == 0.3


class _Data(ember.DataModule):
    def __init__(self, batch_size: int = 8) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.loaded: dict[str, Any] = {}

    def train_dataloader(self) -> DataLoader:
        return make_loader(16, batch_size=self.hparams.batch_size)

    def state_dict(self) -> dict[str, Any]:
        return {"seen": 3}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.loaded = state


def test_a_datamodule_is_rebuilt_from_a_checkpoint() -> None:
    trainer = quiet_trainer(max_steps=1, logger=False)
    trainer.fit(Regressor(), datamodule=_Data(batch_size=4))
    path = trainer.checkpoint_callback.best_model_path
    assert torch.load(path, weights_only=True)[ember.DataModule.CHECKPOINT_HYPER_PARAMS_KEY] == {"batch_size": 4}
    datamodule = _Data.load_from_checkpoint(path)
    assert isinstance(datamodule, _Data) and datamodule.hparams.batch_size == 4 and datamodule.loaded == {"seen": 3}


def test_a_datamodule_s_state_is_kept_under_its_class_s_qualified_name_and_read_back_on_resuming() -> None:
    trainer = quiet_trainer(max_epochs=1, logger=False)
    trainer.fit(Regressor(), datamodule=_Data())
    path = trainer.checkpoint_callback.best_model_path
    checkpoint = torch.load(path, weights_only=True)
    assert checkpoint["_Data"] == {"seen": 3} and "datamodule" not in checkpoint
    resumed = _Data()
    quiet_trainer(max_epochs=2, logger=False).fit(Regressor(), datamodule=resumed, ckpt_path=path)
    assert resumed.loaded == {"seen": 3}
    # Ember 0.1 kept it under "datamodule": its checkpoints still give it back.
    checkpoint["datamodule"] = checkpoint.pop("_Data")
    torch.save(checkpoint, "old.ckpt")
    assert _Data.load_from_checkpoint("old.ckpt").loaded == {"seen": 3}
    older = _Data()
    quiet_trainer(max_epochs=2, logger=False).fit(Regressor(), datamodule=older, ckpt_path="old.ckpt")
    assert older.loaded == {"seen": 3}


def test_a_datamodule_class_named_as_another_checkpoint_entry_is_refused_when_saved() -> None:
    clashing = type("epoch", (_Data,), {})
    with pytest.raises(ValueError, match="under its class's name, 'epoch', which is the name of another"):
        quiet_trainer(max_epochs=1, logger=False).fit(Regressor(), datamodule=clashing())


@pytest.mark.parametrize(("per_node", "global_rank", "called"), [(True, 1, True), (False, 1, False), (False, 0, True)])
def test_prepare_data_per_node_false_prepares_on_global_rank_zero_alone(
    per_node: bool, global_rank: int, called: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls: list[str] = []

    class Data(ember.DataModule):
        def __init__(self) -> None:
            super().__init__()
            self.prepare_data_per_node = per_node

        def prepare_data(self) -> None:
            calls.append("datamodule")

        def test_dataloader(self) -> DataLoader:
            return make_loader(8)

    class Model(Regressor):
        def prepare_data(self) -> None:
            calls.append("module")

    assert ember.DataModule().prepare_data_per_node and Regressor().prepare_data_per_node  # Lightning's default
    model = Model()
    model.prepare_data_per_node = per_node
    trainer = quiet_trainer(logger=False)
    monkeypatch.setattr(type(trainer.strategy), "global_rank", property(lambda self: global_rank))  # local rank 0
    trainer.test(model, datamodule=Data(), verbose=False)
    assert calls == (["datamodule", "module"] if called else [])


def test_loaders_and_a_datamodule_together_are_refused_before_the_stage_starts() -> None:
    class Counted(ember.DataModule):
        def setup(self, stage: str) -> None:
            raise AssertionError("the stage started")

    trainer = quiet_trainer(max_epochs=1, logger=False)
    fit = r"You cannot pass `train_dataloader` or `val_dataloaders` to `trainer.fit\(datamodule=...\)`"
    for loaders in ({"train_dataloaders": make_loader(8)}, {"val_dataloaders": make_loader(8)}):
        with pytest.raises(MisconfigurationException, match=fit):
            trainer.fit(Regressor(), datamodule=Counted(), **loaders)
    with pytest.raises(MisconfigurationException, match="You cannot pass both `trainer.validate"):
        trainer.validate(Regressor(), make_loader(8), datamodule=Counted())
    with pytest.raises(MisconfigurationException, match="You cannot pass both `trainer.test"):
        trainer.test(Regressor(), dataloaders=make_loader(8), datamodule=Counted())


def test_an_object_built_in_another_s_init_records_its_arguments_too() -> None:
    class Head(ember.Module):
        def __init__(self, width: int, dropout: float) -> None:
            super().__init__()
            self.save_hyperparameters(ignore="dropout")

    class Net(ember.Module):
        def __init__(self, lr: float, width: int = 3) -> None:
            super().__init__()
            self.head = Head(width=8, dropout=0.1)

    class Plain:  # its arguments are not hyperparameters: it has none
        def __init__(self, seed: int = 1) -> None:
            self.net = Net(lr=0.1)

    # As Lightning collects them: the outer __init__'s value wins where names meet.
    assert Plain().net.head.hparams == {"width": 3, "lr": 0.1}
    assert Head(width=2, dropout=0.0).hparams == {"width": 2}


def test_hyperparameters_of_any_class() -> None:
    assert _served("pytorch_lightning.core.mixins", "HyperparametersMixin") is HyperparametersMixin

    class Settings(HyperparametersMixin):
        def __init__(self, lr: float = 0.1, name: str = "a") -> None:
            super().__init__()
            self.save_hyperparameters(ignore=["name"])

    assert Settings(lr=0.2).hparams == {"lr": 0.2}


def test_hparams_print_as_lightnings_and_lose_an_attribute_deleted() -> None:
    class Data(ember.DataModule):
        def __init__(self, batch_size: int = 4, data_dir: str = "data", sizes: tuple = (1, 2)) -> None:
            super().__init__()
            self.save_hyperparameters()

    hparams = Data().hparams
    assert repr(hparams) == str(hparams) == '"batch_size": 4\n"data_dir":   data\n"sizes":      (1, 2)'
    del hparams.sizes
    assert hparams == {"batch_size": 4, "data_dir": "data"} and repr(type(hparams)()) == ""
    with pytest.raises(AttributeError, match="'AttributeDict' object has no attribute 'sizes'"):
        del hparams.sizes
    with pytest.raises(AttributeError, match="'AttributeDict' object has no attribute 'sizes'"):
        _ = hparams.sizes


def test_fields_are_found_on_the_module_its_hparams_and_its_datamodule() -> None:
    from ember.hparams import get_field, has_field, set_field

    class Data(BoringDataModule):
        def __init__(self, batch_size: int = 16) -> None:
            super().__init__()
            self.batch_size = batch_size

    class Model(BoringModel):
        def __init__(self, lr: float = 0.1, batch_size: int = 8) -> None:
            super().__init__()
            self.save_hyperparameters()
            self.learning_rate = 0.5
            self.seen: list[Any] = []

        def on_train_start(self) -> None:  # the datamodule is attached: it is read first, and written with the rest
            self.seen.append(get_field(self, "batch_size"))
            set_field(self, "batch_size", 99)
            self.seen += [self.trainer.datamodule.batch_size, self.hparams.batch_size]

    model = Model()
    assert has_field(model, "lr") and has_field(model, "learning_rate") and not has_field(model, "momentum")
    assert get_field(model, "lr") == 0.1 and get_field(model, "batch_size") == 8
    set_field(model, "lr", 0.3)
    set_field(model, "learning_rate", 2.0)
    assert model.hparams.lr == 0.3 and model.learning_rate == 2.0
    for call in (lambda: get_field(model, "momentum"), lambda: set_field(model, "momentum", 0.9)):
        with pytest.raises(AttributeError, match="momentum is neither stored in the model namespace"):
            call()
    quiet_trainer(max_steps=1, logger=False, enable_checkpointing=False).fit(model, datamodule=Data())
    assert model.seen == [16, 99, 99]
    assert _served("pytorch_lightning.utilities.parsing", "lightning_setattr") is set_field

    class NamespaceModel(BoringModel):  # hparams as a namespace answering `in`, as Lightning accepts
        hparams = Namespace(lr=0.1)

    spaced = NamespaceModel()
    assert has_field(spaced, "lr") and get_field(spaced, "lr") == 0.1
    set_field(spaced, "lr", 0.2)
    assert spaced.hparams.lr == 0.2


def test_lightnings_parsing_helpers_inspect_init_and_drop_unpicklable_values() -> None:
    class Net:
        def __init__(self, config: Any, *rest: Any, depth: int = 2, **extra: Any) -> None: ...

    parse_class_init_keys = _served("pytorch_lightning.utilities.parsing", "parse_class_init_keys")
    assert parse_class_init_keys(Net) == ("self", "rest", "extra")
    assert parse_class_init_keys(BoringModel) == ("self", None, None)
    hparams = {"depth": 2, "act": lambda x: x}
    with pytest.warns(UserWarning, match="'act' removed from hparams"):
        _served("pytorch_lightning.utilities.parsing", "clean_namespace")(hparams)
    assert hparams == {"depth": 2}


class _Base:
    def __init__(self, size: int, scale: float = 1.0, **options: Any) -> None:
        super().__init__()
        self.levels = self.record([])

    def record(self, levels: list[dict[str, Any]], only: tuple[type, ...] = ()) -> list[dict[str, Any]]:
        import inspect

        frame = inspect.currentframe()
        assert frame is not None
        collect = _served("pytorch_lightning.utilities.parsing", "collect_init_args")
        return collect(frame, levels, classes=only)  # type: ignore[no-any-return]


class _Derived(_Base):
    def __init__(self, size: int, name: str, scale: float = 1.0, **options: Any) -> None:
        super().__init__(size, scale=scale, **options)


def test_collect_init_args_gives_each_init_in_the_chain_innermost_first() -> None:
    built = _Derived(3, "net", scale=0.5, extra=True)
    assert built.levels == [
        {"size": 3, "scale": 0.5, "extra": True},
        {"size": 3, "name": "net", "scale": 0.5, "extra": True},
    ]
    assert built.record([], only=(int,)) == []  # no frame of a class among those asked for


@pytest.mark.parametrize("value", [42, 3.5, True])
def test_a_primitive_is_no_config(value: Any) -> None:
    class Model(ember.Module):
        def __init__(self, value: Any) -> None:
            super().__init__()
            self.save_hyperparameters(value)

    with pytest.raises(ValueError, match=r"Primitives \(<class 'bool'>"):
        Model(value)


@pytest.mark.parametrize("config", [["lr", "depth"], object()])
def test_a_config_neither_a_mapping_nor_a_namespace_is_refused(config: Any) -> None:
    with pytest.raises(ValueError, match=rf"Unsupported config type of {type(config)}\. Pass the names of"):
        _Configured(config)


def test_a_module_among_the_hyperparameters_is_pointed_out() -> None:
    class Model(ember.Module):
        def __init__(self, encoder: torch.nn.Module, depth: int = 2) -> None:
            super().__init__()
            self.save_hyperparameters()

    with pytest.warns(UserWarning, match=r"'encoder' is an instance of `nn.Module` and is already saved"):
        model = Model(torch.nn.Linear(2, 2))
    assert list(model.hparams) == ["encoder", "depth"]


def test_the_loggers_get_the_initial_hyperparameters() -> None:
    model = Regressor(lr=0.5)
    model.hparams.lr = 0.1
    trainer = quiet_trainer(max_steps=1, logger=CSVLogger("logs"))
    trainer.fit(model, make_loader(16))
    with open(os.path.join(trainer.log_dir, "hparams.yaml")) as file:
        assert "lr: 0.5" in file.read()


def test_the_module_and_datamodule_may_not_disagree_on_a_hyperparameter() -> None:
    class Data(_Data):
        def __init__(self, lr: float = 0.5) -> None:
            super().__init__()
            self.save_hyperparameters()

    with pytest.raises(RuntimeError, match=r"Error while merging hparams: the keys \['lr'\] are present in both"):
        quiet_trainer(max_steps=1, logger=CSVLogger("logs")).fit(Regressor(lr=0.1), datamodule=Data())
    quiet_trainer(max_steps=1, logger=CSVLogger("logs")).fit(Regressor(lr=0.5), datamodule=Data())


def test_hyperparameters_that_cannot_be_pickled_are_dropped_when_a_stage_starts() -> None:
    assert _served("pytorch_lightning.utilities", "is_picklable") is ember.utilities.is_picklable

    class Model(Regressor):
        def __init__(self, lr: float = 0.05, transform: Any = lambda x: x) -> None:
            super().__init__(lr)
            self.save_hyperparameters()

    model = Model()
    assert not ember.utilities.is_picklable(model.hparams.transform)
    with pytest.warns(UserWarning, match="Attribute 'transform' removed from hparams because it cannot be pickled"):
        quiet_trainer(max_steps=1, logger=False).fit(model, make_loader(16))
    assert "transform" not in model.hparams


# ----------------------------------------------------------------------------- hook order
class _Recorder(Callback):
    def __init__(self, calls: list[str], name: str = "callback", reads_epoch_metrics: bool = False) -> None:
        self.calls, self.name, self.reads_epoch_metrics = calls, name, reads_epoch_metrics

    def setup(self, trainer: Any, module: Any, stage: str) -> None:
        self.calls.append(f"{self.name}.setup")

    def teardown(self, trainer: Any, module: Any, stage: str) -> None:
        self.calls.append(f"{self.name}.teardown")

    def on_fit_start(self, trainer: Any, module: Any) -> None:
        self.calls.append(f"{self.name}.on_fit_start")

    def on_train_batch_start(self, trainer: Any, module: Any, batch: Any, batch_idx: int) -> None:
        self.calls.append(f"{self.name}.on_train_batch_start")

    def on_before_backward(self, trainer: Any, module: Any, loss: torch.Tensor) -> None:
        self.calls.append(f"{self.name}.on_before_backward")

    def on_train_epoch_end(self, trainer: Any, module: Any) -> None:
        self.calls.append(f"{self.name}.on_train_epoch_end")

    def on_save_checkpoint(self, trainer: Any, module: Any, checkpoint: dict[str, Any]) -> None:
        self.calls.append(f"{self.name}.on_save_checkpoint")

    def on_load_checkpoint(self, trainer: Any, module: Any, checkpoint: dict[str, Any]) -> None:
        self.calls.append(f"{self.name}.on_load_checkpoint")


class _RecordingModel(Regressor):
    def __init__(self, calls: list[str]) -> None:
        super().__init__()
        self.calls = calls

    def prepare_data(self) -> None:
        self.calls.append("module.prepare_data")

    def setup(self, stage: str) -> None:
        self.calls.append(f"module.setup({stage})")

    def teardown(self, stage: str) -> None:
        self.calls.append("module.teardown")

    def on_fit_start(self) -> None:
        self.calls.append("module.on_fit_start")

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> int:
        self.calls.append("module.on_train_batch_start")
        return -1 if self.current_epoch == 1 else 0  # the second epoch is skipped

    def on_before_backward(self, loss: torch.Tensor) -> None:
        self.calls.append("module.on_before_backward")

    def on_train_epoch_end(self) -> None:
        self.calls.append("module.on_train_epoch_end")

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        self.calls.append("module.on_save_checkpoint")

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        self.calls.append("module.on_load_checkpoint")


class _RecordingData(ember.DataModule):
    def __init__(self, calls: list[str]) -> None:
        super().__init__()
        self.calls = calls

    def prepare_data(self) -> None:
        self.calls.append("data.prepare_data")

    def setup(self, stage: str) -> None:
        self.calls.append("data.setup")

    def teardown(self, stage: str) -> None:
        self.calls.append("data.teardown")

    def train_dataloader(self) -> DataLoader:
        return make_loader(8, batch_size=4)


def test_the_callbacks_hook_runs_before_the_module_s_as_in_lightning() -> None:
    calls: list[str] = []
    callbacks = [_Recorder(calls), _Recorder(calls, "checkpointing", reads_epoch_metrics=True)]
    trainer = quiet_trainer(max_epochs=2, logger=False, enable_checkpointing=False, callbacks=callbacks)
    trainer.fit(_RecordingModel(calls), datamodule=_RecordingData(calls))
    trainer.save_checkpoint("saved.ckpt")
    first_epoch = [
        "callback.on_train_batch_start", "checkpointing.on_train_batch_start", "module.on_train_batch_start",
        "callback.on_before_backward", "checkpointing.on_before_backward", "module.on_before_backward",
    ] * 2  # fmt: skip
    epoch_end = ["callback.on_train_epoch_end", "module.on_train_epoch_end", "checkpointing.on_train_epoch_end"]
    assert calls == [
        "data.prepare_data", "module.prepare_data", "data.setup", "callback.setup", "checkpointing.setup",
        "module.setup(fit)", "callback.on_fit_start", "checkpointing.on_fit_start", "module.on_fit_start",
        *first_epoch, *epoch_end,
        # The callbacks see the batch whose module hook then skips the rest of the epoch.
        "callback.on_train_batch_start", "checkpointing.on_train_batch_start", "module.on_train_batch_start",
        *epoch_end,
        "data.teardown", "callback.teardown", "checkpointing.teardown", "module.teardown",
        "callback.on_save_checkpoint", "checkpointing.on_save_checkpoint", "module.on_save_checkpoint",
    ]  # fmt: skip
    calls.clear()
    quiet_trainer(max_epochs=3, logger=False, enable_checkpointing=False, callbacks=callbacks).fit(
        _RecordingModel(calls), make_loader(8, batch_size=4), ckpt_path="saved.ckpt"
    )
    loading = [call for call in calls if call.endswith("on_load_checkpoint")]
    assert loading == ["module.on_load_checkpoint", "callback.on_load_checkpoint", "checkpointing.on_load_checkpoint"]


def test_setup_and_teardown_take_the_stage_by_keyword() -> None:
    stages: list[Any] = []

    class Model(Regressor):
        def setup(self, *, stage: str) -> None:
            stages.append(stage)

        def teardown(self, *, stage: str) -> None:
            stages.append(stage)

    model = Model()
    trainer = quiet_trainer(max_steps=1, logger=False)
    trainer.fit(model, make_loader(8))
    trainer.validate(model, make_loader(8), verbose=False)
    assert stages == ["fit", "fit", "validate", "validate"]
    assert [stage.value for stage in stages] == stages and f"{stages[0]}" == "fit"


def test_a_stage_that_raises_skips_teardown_as_in_lightning() -> None:
    calls: list[str] = []

    class Failing(Regressor):
        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            raise RuntimeError("boom")

        def on_exception(self, exception: BaseException) -> None:
            calls.append("module.on_exception")

        def teardown(self, stage: str) -> None:
            calls.append("module.teardown")

    class Watching(Callback):
        def on_exception(self, trainer: Any, module: Any, exception: BaseException) -> None:
            calls.append("callback.on_exception")

        def teardown(self, trainer: Any, module: Any, stage: str) -> None:
            calls.append("callback.teardown")

    with pytest.raises(RuntimeError, match="boom"):
        quiet_trainer(max_steps=1, logger=False, callbacks=[Watching()]).fit(Failing(), make_loader(8))
    assert "module.teardown" not in calls and "callback.teardown" not in calls
    assert "callback.on_exception" in calls


def test_the_module_s_callbacks_are_asked_for_at_each_stage() -> None:
    asked: list[str] = []

    class Model(Regressor):
        def configure_callbacks(self) -> list[Callback]:
            asked.append(self.trainer.state.fn)
            return [ember.callbacks.ModelCheckpoint(monitor="val_loss"), ember.callbacks.LambdaCallback()]

    model = Model()
    trainer = quiet_trainer(max_epochs=2, logger=False)
    trainer.fit(model, make_loader(16), make_loader(8))
    best = trainer.checkpoint_callback.best_model_path  # type: ignore[union-attr]
    trainer.test(dataloaders=make_loader(8), ckpt_path="best", verbose=False)  # a fresh ModelCheckpoint knows it
    assert asked == ["fit", "test"] and trainer.ckpt_path == best
    # each stage's replace the earlier ones of their type
    assert sorted(type(callback).__name__ for callback in trainer.callbacks) == ["LambdaCallback", "ModelCheckpoint"]


# -------------------------------------------------------------------------------- the module
def test_a_module_not_attached_to_a_trainer_says_so() -> None:
    ensemble, member = ember.Module(), ember.Module()
    ensemble.member = member
    with pytest.raises(RuntimeError, match="Module is not attached to a `Trainer`"):
        _ = ensemble.trainer
    trainer = quiet_trainer(logger=False)
    ensemble.trainer = trainer
    assert member.trainer is trainer  # the modules it holds are attached with it


def test_a_module_attached_to_a_trainer_can_be_scripted() -> None:
    model = BoringModel()
    model.trainer = quiet_trainer(logger=False)
    scripted = torch.jit.script(model)
    assert scripted(torch.ones(1, 32)).shape == (1, 2)


class _Clipping(BoringModel):
    def __init__(self, **clip: Any) -> None:
        super().__init__()
        self.clip = clip

    def configure_gradient_clipping(self, optimizer: Any, gradient_clip_val: Any, gradient_clip_algorithm: Any) -> None:
        self.received = (gradient_clip_val, gradient_clip_algorithm)  # the Trainer's flags
        self.clip_gradients(optimizer, **self.clip)


@pytest.mark.parametrize(
    ("flags", "clip", "refused"),
    [
        ({"gradient_clip_val": 1e-4}, {"gradient_clip_val": 0.01}, r"`Trainer\(gradient_clip_val=0.0001\)` and have "
         r"passed `clip_gradients\(gradient_clip_val=0.01\)`"),
        ({"gradient_clip_algorithm": "norm"}, {"gradient_clip_algorithm": "value"}, r"gradient_clip_algorithm='norm'"),
        ({}, {"gradient_clip_algorithm": "l1"}, r"`gradient_clip_algorithm` l1 is invalid. Allowed algorithms: \['v"),
    ],
)  # fmt: skip
def test_clipping_both_in_the_trainer_and_the_module_is_refused(flags: dict, clip: dict, refused: str) -> None:
    trainer = quiet_trainer(max_steps=1, logger=False, **flags)
    with pytest.raises(ember.exceptions.MisconfigurationException, match=refused):
        trainer.fit(_Clipping(**clip))


@pytest.mark.parametrize("algorithm", ["value", "VALUE"])  # any case, as the Trainer's flag
def test_the_module_clips_as_it_chooses_when_the_trainer_does_not(algorithm: str) -> None:
    model = _Clipping(gradient_clip_val=1e-6, gradient_clip_algorithm=algorithm)
    before = [parameter.detach().clone() for parameter in model.parameters()]
    quiet_trainer(max_steps=1, logger=False, enable_checkpointing=False).fit(model)
    # SGD at lr 0.1 moves each weight by 0.1 times its gradient, clamped to 1e-6 (unclamped, about 0.1).
    moved = max(float((after.detach() - old).abs().max()) for after, old in zip(model.parameters(), before))
    assert 0 < moved < 1e-6 and model.received == (None, None)


def test_lightning_s_clipping_algorithm_names_are_served_and_taken() -> None:
    algorithms = _served("lightning.pytorch.utilities", "GradClipAlgorithmType")
    assert [algorithms.VALUE, algorithms.NORM] == ["value", "norm"] and algorithms("norm") is algorithms.NORM
    model = _Clipping()
    trainer = quiet_trainer(max_steps=1, logger=False, gradient_clip_val=1e-6, gradient_clip_algorithm=algorithms.VALUE)
    before = [parameter.detach().clone() for parameter in model.parameters()]
    trainer.fit(model)
    moved = max(float((after.detach() - old).abs().max()) for after, old in zip(model.parameters(), before))
    assert 0 < moved < 1e-6 and model.received == (1e-6, "value")


# ------------------------------------------------------------------------------ the flags
def test_flags_default_to_the_environment_s(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PL_TRAINER_LOGGER", "False")
    monkeypatch.setenv("PL_TRAINER_MAX_STEPS", "7")
    monkeypatch.setenv("PL_TRAINER_ACCELERATOR", "cpu")  # not a Python literal: the string
    trainer = ember.Trainer()
    assert trainer.logger is None and trainer.max_steps == 7 and trainer.config.accelerator == "cpu"
    trainer = ember.Trainer(logger=CSVLogger("logs"), max_steps=42)  # a flag given wins
    assert isinstance(trainer.logger, CSVLogger) and trainer.max_steps == 42


def test_max_epochs_is_resolved_when_fit_starts() -> None:
    assert _served("lightning_fabric.utilities.warnings", "PossibleUserWarning") is PossibleUserWarning
    assert _served("pytorch_lightning.utilities.warnings", "PossibleUserWarning") is PossibleUserWarning
    trainer = quiet_trainer(logger=False, enable_checkpointing=False, limit_train_batches=1)
    assert trainer.max_epochs is None

    class StopsAtOnce(Regressor):
        def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
            self.trainer.should_stop = True

    for _ in range(2):  # at each fit, not once per process (the tests of a session each expect it)
        with pytest.warns(PossibleUserWarning, match="`max_epochs` was not set. Setting it to 1000 epochs"):
            quiet_trainer(logger=False, enable_checkpointing=False).fit(StopsAtOnce(), make_loader(8))
    with pytest.warns(PossibleUserWarning, match="`max_epochs` was not set. Setting it to 1000 epochs") as caught:
        trainer.fit(StopsAtOnce(), make_loader(8))
    assert {w.filename for w in caught if w.category is PossibleUserWarning} == {__file__}  # the line calling fit
    assert trainer.max_epochs == 1000
    trainer = quiet_trainer(max_steps=1, logger=False, enable_checkpointing=False)
    trainer.fit(Regressor(), make_loader(8))
    assert trainer.max_epochs == -1  # another limit was given


@pytest.mark.parametrize(
    "flags",
    [{"logger": True}, {"enable_checkpointing": True}, {"enable_progress_bar": True}, {"enable_model_summary": True},
     {"log_every_n_steps": 1}, {"num_sanity_val_steps": 1}, {"fast_dev_run": 1}, {"profiler": "simple"}],
)  # fmt: skip
def test_barebones_refuses_a_feature_asked_for(flags: dict[str, Any]) -> None:
    ((flag, value),) = flags.items()
    with pytest.raises(MisconfigurationException, match=rf"`Trainer\(barebones=True, {flag}={value!r}\)` was passed"):
        ember.Trainer(barebones=True, **flags)


def test_barebones_takes_a_feature_turned_off() -> None:
    trainer = ember.Trainer(barebones=True, logger=False, enable_checkpointing=False, num_sanity_val_steps=0,
                            log_every_n_steps=0)  # fmt: skip
    assert trainer.barebones and trainer.loggers == [] and trainer.checkpoint_callback is None
    assert trainer.log_every_n_steps == 0 and trainer.num_sanity_val_steps == 0 and not trainer.fast_dev_run


@pytest.mark.parametrize("stage", ["validate", "test", "predict"])
@pytest.mark.parametrize("inference_mode", [True, False])
def test_evaluation_hooks_run_without_gradients_from_the_start(stage: str, inference_mode: bool) -> None:
    seen: list[tuple[bool, bool]] = []

    class Model(BoringModel):
        def on_validation_start(self) -> None:
            seen.append((torch.is_grad_enabled(), torch.is_inference_mode_enabled()))

        on_test_start = on_predict_start = on_validation_end = on_test_end = on_predict_end = on_validation_start

    inputs = DataLoader(torch.randn(4, 32), batch_size=2)
    getattr(quiet_trainer(logger=False, inference_mode=inference_mode), stage)(Model(), inputs)
    assert seen == [(False, inference_mode)] * 2  # the start and the end of the stage


def test_the_tuner_finds_nothing_in_a_fast_dev_run() -> None:
    from ember.tuner import Tuner

    model = BoringModel()
    model.lr, model.batch_size = 0.1, 8
    tuner = Tuner(ember.Trainer(fast_dev_run=True, logger=False))
    with pytest.warns(UserWarning, match="Skipping learning rate finder since `fast_dev_run` is enabled"):
        assert tuner.lr_find(model) is None
    with pytest.warns(UserWarning, match="Skipping batch size scaler since `fast_dev_run` is enabled"):
        assert tuner.scale_batch_size(model) is None


def test_a_datamodule_prints_what_each_loader_hook_gives() -> None:
    class Stream(torch.utils.data.IterableDataset):
        def __iter__(self) -> Any:
            yield torch.zeros(4)

    class Data(ember.DataModule):
        def setup(self, stage: str) -> None:
            self.ready = True

        def train_dataloader(self) -> Any:
            return [make_loader(16), DataLoader(Stream())]  # several loaders, one without a length

        def val_dataloader(self) -> Any:
            return make_loader(8)

        def test_dataloader(self) -> Any:
            assert self.ready  # fails before setup
            return make_loader(8)

    data = Data()
    assert str(data) == (
        "{Train dataloader: 1. size=16 ; 2. size=NA}\n{Validation dataloader: size=8}\n{Test dataloader: None}\n"
        "{Predict dataloader: None}"
    )
    data.setup("test")
    assert str(data).splitlines()[2] == "{Test dataloader: size=8}"


def test_hyperparameters_round_trip_through_a_tags_csv_file(tmp_path: Any) -> None:
    from ember.hparams import load_hparams_from_tags_csv, save_hparams_to_tags_csv

    path = tmp_path / "meta_tags.csv"
    save_hparams_to_tags_csv(path, Namespace(name="adam", lr=0.008, layers=32, frozen=True, sizes=[2, 3]))
    assert path.read_text().splitlines()[0] == "key,value"
    loaded = load_hparams_from_tags_csv(path)
    assert loaded == {"name": "adam", "lr": 0.008, "layers": 32, "frozen": True, "sizes": [2, 3]}
    assert _served("pytorch_lightning.core.saving", "load_hparams_from_tags_csv") is load_hparams_from_tags_csv
    with pytest.warns(RuntimeWarning, match="no file"):
        assert load_hparams_from_tags_csv(tmp_path / "missing.csv") == {}
    with pytest.raises(RuntimeError, match="no folder"):
        save_hparams_to_tags_csv(tmp_path / "absent" / "meta_tags.csv", {"lr": 0.1})
