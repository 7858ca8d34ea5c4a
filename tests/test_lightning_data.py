"""Data loading as Lightning programs expect it: steps and loader hooks switched off with None, several training
loaders, the loaders the Trainer shows, when loaders are asked for, a time-based val_check_interval, and the
datamodule's own behaviour."""

from __future__ import annotations

import math
import warnings
from collections.abc import Iterator
from datetime import timedelta
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from conftest import Regressor, make_data, make_loader, parameters_of, quiet_trainer
from test_lightning_compat import served_by_ember
from torch.utils.data import DataLoader, Sampler, SequentialSampler

import ember
from ember import data_workers
from ember.callbacks import Callback
from ember.combined_loader import CombinedLoader
from ember.exceptions import MisconfigurationException, PossibleUserWarning
from ember.loops import training_data
from ember.trainer_parts import validates_in_fit


# --------------------------------------------------------------------------- switched off with None
def test_validation_step_set_to_none_skips_validation() -> None:
    model = Regressor()
    model.validation_step = None  # type: ignore[assignment,method-assign]
    model.val_dataloader = None  # type: ignore[attr-defined]
    trainer = quiet_trainer(max_epochs=1, logger=False, enable_checkpointing=False, num_sanity_val_steps=2)
    trainer.fit(model, make_loader(16), make_loader(16))
    assert trainer.global_step == 2 and not trainer.validation_enabled


def test_a_loader_hook_set_to_none_is_absent() -> None:
    class WithLoaders(Regressor):
        def train_dataloader(self) -> DataLoader:
            return make_loader(16)

        def val_dataloader(self) -> DataLoader:
            raise AssertionError("switched off: never called")

    model = WithLoaders()
    model.val_dataloader = None  # type: ignore[assignment,method-assign]
    trainer = quiet_trainer(max_epochs=1, logger=False, enable_checkpointing=False)
    trainer.fit(model)
    assert trainer.global_step == 2 and trainer.num_val_batches == []
    model.test_step = None  # type: ignore[assignment,method-assign]
    with pytest.raises(MisconfigurationException, match=r"No `test_step\(\)` method defined"):
        trainer.test(model, make_loader(8))


def test_a_training_loader_hook_set_to_none_is_lightnings_type_error() -> None:
    model = Regressor()
    model.train_dataloader = None  # type: ignore[attr-defined]
    trainer = quiet_trainer(max_steps=1, logger=False, enable_checkpointing=False)
    with pytest.raises(TypeError, match=r"passed to `Trainer.fit\(train_dataloaders=...\)`. Found None. Either pass"):
        trainer.fit(model)
    with pytest.raises(MisconfigurationException, match="`train_dataloader` must be implemented"):
        trainer.fit(Regressor())  # not defined at all: the hook's own error


def test_the_training_batches_are_unbounded_before_fit() -> None:
    trainer = quiet_trainer(max_steps=1, logger=False, enable_checkpointing=False)
    assert math.isinf(trainer.num_training_batches) and trainer.num_val_batches == []
    trainer.fit(Regressor(), make_loader(16))
    assert trainer.num_training_batches == 2


# --------------------------------------------------------------------------- several training loaders
class _TwoSources(Regressor):
    """Trains on the batch of source "a"; records the structure of each combined batch."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[Any] = []

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        self.seen.append({key: None if value is None else len(value[0]) for key, value in batch.items()})
        return super().training_step(batch["a"], batch_idx)


def _sources() -> dict[str, DataLoader]:
    return {"a": make_loader(32, batch_size=4), "b": make_loader(12, batch_size=4)}  # 8 and 3 batches


@pytest.mark.parametrize(("mode", "batches", "last"), [("max_size_cycle", 8, {"a": 4, "b": 4}),
                                                        ("min_size", 3, {"a": 4, "b": 4}),
                                                        ("max_size", 8, {"a": 4, "b": None})])  # fmt: skip
def test_training_reads_several_loaders_together(mode: str, batches: int, last: dict[str, Any]) -> None:
    model = _TwoSources()
    trainer = quiet_trainer(max_epochs=1, logger=False, enable_checkpointing=False)
    trainer.fit(model, CombinedLoader(_sources(), mode))  # type: ignore[arg-type]
    assert trainer.num_training_batches == batches == len(model.seen) and model.seen[-1] == last


def test_a_dict_of_training_loaders_cycles_the_shorter_ones() -> None:
    model = _TwoSources()
    trainer = quiet_trainer(max_epochs=1, logger=False, enable_checkpointing=False)
    sources = _sources()
    trainer.fit(model, sources)  # type: ignore[arg-type]
    assert trainer.num_training_batches == 8 and trainer.train_dataloader == sources
    combined = CombinedLoader(sources, "max_size_cycle")
    assert len(combined) == 8 and [index for _, index, _ in combined] == list(range(8))


def test_a_list_of_numbers_in_a_combined_loader_is_one_iterable() -> None:
    combined = CombinedLoader({"numbers": [10, 11, 12], "more": {"letters": ("a", "b")}, "range": range(3)})
    assert combined.flattened == [[10, 11, 12], ("a", "b"), range(3)]
    assert [batch for batch, _, _ in combined] == [{"numbers": 10, "more": {"letters": "a"}, "range": 0},
                                                   {"numbers": 11, "more": {"letters": "b"}, "range": 1}]  # fmt: skip
    sequential = CombinedLoader([[1, 2], [], range(1)], "sequential")
    assert list(sequential) == [(1, 0, 0), (2, 1, 0), (0, 0, 2)] and len(sequential) == 3


def test_iter_of_a_combined_loader_starts_its_loaders_at_once() -> None:
    started: list[str] = []

    class Loader:
        def __init__(self, name: str) -> None:
            self.name = name

        def __iter__(self) -> Any:
            started.append(self.name)
            return iter([self.name])

    for mode, first in (("min_size", ["a", "b"]), ("max_size", ["a", "b"]), ("sequential", ["a"])):
        started.clear()
        batches = iter(CombinedLoader({"a": Loader("a"), "b": Loader("b")}, mode))
        assert started == first  # (the sequential mode starts the others in their turn)
        assert [batch for batch, _, _ in batches] == ([{"a": "a", "b": "b"}] if mode != "sequential" else ["a", "b"])


def test_prediction_takes_a_combined_loader_in_the_sequential_mode_only() -> None:
    inputs = DataLoader(torch.randn(4, 4), batch_size=2)
    trainer = quiet_trainer(logger=False)
    with pytest.raises(ValueError, match=r"`CombinedLoader\(mode=.sequential.\)` mode: got mode=.min_size"):
        trainer.predict(Regressor(), CombinedLoader([inputs, inputs], "min_size"))  # type: ignore[arg-type]
    predictions = trainer.predict(Regressor(), CombinedLoader([inputs, inputs], "sequential"))  # type: ignore[arg-type]
    assert [len(outputs) for outputs in predictions] == [2, 2]


def test_a_combined_loader_gives_its_loaders_samplers_in_their_structure() -> None:
    shuffled, ordered = make_loader(8, shuffle=True), make_loader(8)
    combined = CombinedLoader({"a": shuffled, "b": [ordered, range(3)]})
    assert combined.sampler == {"a": shuffled.sampler, "b": [ordered.sampler, None]}
    assert combined.batch_sampler == {"a": shuffled.batch_sampler, "b": [ordered.batch_sampler, None]}
    assert CombinedLoader(ordered).sampler is ordered.sampler
    with pytest.raises(ValueError, match=r"Mismatch in flattened length \(1\) and existing length \(3\)"):
        combined.flattened = [ordered]
    combined.flattened = [ordered, range(2), shuffled]  # replaced in its structure, as Lightning's setter does
    assert combined.iterables == {"a": ordered, "b": [range(2), shuffled]}
    assert combined.sampler == {"a": ordered.sampler, "b": [None, shuffled.sampler]}
    with pytest.raises(ValueError, match="Unsupported mode 'cycle' for CombinedLoader: the modes are min_size, "):
        CombinedLoader([ordered], "cycle")  # type: ignore[arg-type]


def test_combined_loader_is_served_at_lightnings_paths() -> None:
    with served_by_ember():
        from lightning.pytorch.utilities import CombinedLoader as FromUtilities
        from pytorch_lightning.utilities.combined_loader import CombinedLoader as FromItsModule
    assert FromUtilities is FromItsModule is CombinedLoader


def test_sequential_training_is_refused_when_the_epoch_starts() -> None:
    trainer = quiet_trainer(max_epochs=1, logger=False, enable_checkpointing=False)
    with pytest.raises(MisconfigurationException, match="does not support a CombinedLoader in the 'sequential'"):
        trainer.fit(_TwoSources(), CombinedLoader(_sources(), "sequential"))  # type: ignore[arg-type]
    assert trainer.num_training_batches == 8 + 3


def test_several_training_loaders_resume_mid_epoch_exactly(tmp_path: Any) -> None:
    def sources() -> dict[str, DataLoader]:
        return {"a": make_loader(32, batch_size=4, shuffle=True), "b": make_loader(12, batch_size=4, shuffle=True)}

    def fit(model: ember.Module, **flags: Any) -> None:
        trainer = quiet_trainer(max_epochs=2, logger=False, enable_checkpointing=False, **flags)
        trainer.fit(model, sources(), ckpt_path=flags.pop("ckpt_path", None))  # type: ignore[arg-type]

    ember.seed_everything(3)
    reference = _TwoSources()
    fit(reference)
    path = str(tmp_path / "mid-epoch.ckpt")

    class SaveAndStop(Callback):
        def on_train_batch_end(self, trainer: ember.Trainer, *_: Any) -> None:
            if trainer.global_step == 5:
                trainer.save_checkpoint(path)
                raise KeyboardInterrupt

    ember.seed_everything(3)
    with pytest.raises(SystemExit):
        fit(_TwoSources(), callbacks=[SaveAndStop()])
    resumed = _TwoSources()
    quiet_trainer(max_epochs=2, logger=False, enable_checkpointing=False).fit(resumed, sources(), ckpt_path=path)  # type: ignore[arg-type]
    assert resumed.seen == reference.seen[5:]
    for mine, theirs in zip(parameters_of(resumed), parameters_of(reference), strict=True):
        assert torch.equal(mine, theirs)


def test_a_loader_whose_length_raises_not_implemented_has_no_length() -> None:
    class Unsized(DataLoader):
        def __len__(self) -> int:
            raise NotImplementedError

    trainer = quiet_trainer(max_steps=5, logger=False, enable_checkpointing=False, val_check_interval=3)
    trainer.fit(Regressor(), Unsized(make_data(64), batch_size=4), Unsized(make_data(8), batch_size=4))
    assert trainer.global_step == 5 and math.isinf(trainer.num_training_batches)


# --------------------------------------------------------------------------- the loaders the Trainer shows
def test_the_trainer_shows_the_loaders_it_was_given() -> None:
    train, val = make_loader(16), make_loader(16)
    trainer = quiet_trainer(max_epochs=1, logger=False, enable_checkpointing=False)
    trainer.fit(Regressor(), train, val)
    assert trainer.train_dataloader is train and trainer.val_dataloaders is val
    tests = [make_loader(8), make_loader(8)]
    trainer.test(Regressor(), tests, verbose=False)
    assert trainer.test_dataloaders is tests
    trainer.validate(Regressor(), [val], verbose=False)
    assert trainer.val_dataloaders == [val]  # as given: a list of one stays a list


def test_overfit_batches_reads_in_order_and_says_so() -> None:
    class Backwards(Sampler[int]):
        def __init__(self, size: int) -> None:
            self.size = size

        def __iter__(self) -> Iterator[int]:
            return iter(range(self.size - 1, -1, -1))

        def __len__(self) -> int:
            return self.size

    data = make_data(32)
    train = DataLoader(data, batch_size=4, sampler=Backwards(32))
    trainer = quiet_trainer(max_epochs=1, logger=False, enable_checkpointing=False, overfit_batches=2)
    with pytest.warns(UserWarning, match="You requested to overfit but enabled train dataloader shuffling"):
        trainer.fit(Regressor(), train, make_loader(16, shuffle=True))
    assert isinstance(trainer.train_dataloader.sampler, SequentialSampler) and trainer.train_dataloader is not train
    assert isinstance(trainer.val_dataloaders.sampler, SequentialSampler) and trainer.num_training_batches == 2


@pytest.mark.parametrize("stage", ["fit", "validate", "test", "predict"])
def test_a_shuffling_evaluation_loader_is_warned_about(stage: str) -> None:
    trainer = quiet_trainer(max_epochs=1, logger=False, enable_checkpointing=False)
    kind = {"fit": "val", "validate": "val"}.get(stage, stage)
    with pytest.warns(PossibleUserWarning, match=f"Your `{kind}_dataloader`'s sampler has shuffling enabled"):
        if stage == "fit":
            trainer.fit(Regressor(), make_loader(16), make_loader(16, shuffle=True))
        elif stage == "predict":  # a loader of inputs alone, which the module's forward takes
            trainer.predict(Regressor(), DataLoader(torch.randn(16, 4), batch_size=8, shuffle=True))
        else:
            getattr(trainer, stage)(Regressor(), make_loader(16, shuffle=True))
    with warnings.catch_warnings():  # a training loader that shuffles, or one read in order, is not
        warnings.simplefilter("error", PossibleUserWarning)
        quiet_trainer(max_epochs=1, logger=False, enable_checkpointing=False, log_every_n_steps=1).fit(
            Regressor(), make_loader(16, shuffle=True), make_loader(16)
        )


def test_a_validation_step_or_loader_without_the_other_is_warned_about() -> None:
    trainer = quiet_trainer(max_epochs=1, logger=False, enable_checkpointing=False)
    with pytest.warns(PossibleUserWarning, match="You defined a `validation_step` but have no `val_dataloader`"):
        trainer.fit(Regressor(), make_loader(16))
    model = Regressor()
    model.validation_step = None  # type: ignore[assignment,method-assign]
    with pytest.warns(UserWarning, match="You passed in a `val_dataloader` but have no `validation_step`"):
        quiet_trainer(max_epochs=1, logger=False, enable_checkpointing=False).fit(
            model, make_loader(16), make_loader(8)
        )
    with warnings.catch_warnings():  # both, or neither: nothing to say
        warnings.simplefilter("error")
        assert validates_in_fit(Regressor(), True) and not validates_in_fit(model, False)


def test_lightning_programs_get_lightnings_advice_on_loader_workers(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(data_workers, "cores_per_process", lambda: 8)
    few = r"The 'val_dataloader' does not have many workers .* `num_workers=7` in the `DataLoader`"
    with served_by_ember(), pytest.warns(PossibleUserWarning, match=few):
        quiet_trainer(max_epochs=1, logger=False).fit(Regressor(), make_loader(16), make_loader(8))
    spawned = DataLoader(make_data(8), num_workers=1, multiprocessing_context="spawn")
    with pytest.warns(UserWarning, match="Consider setting `persistent_workers=True` in 'train_dataloader'"):
        data_workers.check_workers(spawned, "train")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        data_workers.check_workers(DataLoader(make_data(8), num_workers=2), "train")  # enough workers
        quiet_trainer(max_epochs=1, logger=False).fit(Regressor(), make_loader(16), make_loader(8))  # Ember's own


def test_a_loader_that_is_not_iterable_is_refused_when_the_stage_starts() -> None:
    trainer = quiet_trainer(max_epochs=1, logger=False, enable_checkpointing=False)
    with pytest.raises(TypeError, match=r"An invalid dataloader was passed to `Trainer.fit\(train_dataloaders=...\)`. "
                       "Found 5"):  # fmt: skip
        trainer.fit(Regressor(), 5)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"passed to `Trainer.test\(dataloaders=...\)`. Found 3.5"):
        trainer.test(Regressor(), 3.5)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"passed to `Trainer.fit\(val_dataloaders=...\)`. Found \[1, <object"):
        trainer.fit(Regressor(), make_loader(8), [1, object()])

    class Returns(Regressor):
        def val_dataloader(self) -> Any:
            return 2

    with pytest.raises(TypeError, match=r"returned from `Returns.val_dataloader\(\)`. Found 2"):
        trainer.validate(Returns())


def test_an_evaluation_without_batches_is_skipped_with_its_hooks() -> None:
    calls: list[str] = []

    class Hooked(Regressor):
        def on_test_start(self) -> None:
            calls.append("on_test_start")

        def on_validation_epoch_end(self) -> None:
            calls.append("on_validation_epoch_end")

        def on_predict_start(self) -> None:
            calls.append("on_predict_start")

    trainer = quiet_trainer(logger=False)
    with pytest.warns(UserWarning, match="Total length of `DataLoader` across ranks is zero"):
        assert trainer.test(Hooked(), make_loader(0), verbose=False) == [] and trainer.num_test_batches == [0]
    assert trainer.test(Hooked(), [], verbose=False) == []
    assert quiet_trainer(limit_val_batches=0).validate(Hooked(), make_loader(8), verbose=False) == []
    assert quiet_trainer(limit_predict_batches=0).predict(Hooked(), DataLoader(torch.randn(8, 4))) is None
    assert calls == []
    assert list(trainer.test(Hooked(), make_loader(8), verbose=False)[0]) == ["test_loss"]  # with a batch: run
    assert calls == ["on_test_start"]


# --------------------------------------------------------------------------- when loaders are asked for
class _Recording(Regressor):
    """Records each call of its loader hooks: (kind, epoch, whether the sanity check runs)."""

    def __init__(self, steps_in_configure: bool = False) -> None:
        super().__init__()
        self.calls: list[tuple[str, int, bool]] = []
        self.steps_in_configure = steps_in_configure

    def train_dataloader(self) -> DataLoader:
        self.calls.append(("train", self.current_epoch, self.trainer.sanity_checking))
        return make_loader(16)

    def val_dataloader(self) -> DataLoader:
        self.calls.append(("val", self.current_epoch, self.trainer.sanity_checking))
        return make_loader(16)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        if self.steps_in_configure:
            assert self.trainer.estimated_stepping_batches == 2
        return super().configure_optimizers()


@pytest.mark.parametrize(
    ("sanity_steps", "steps_in_configure", "calls"),
    [
        (2, False, [("val", 0, True), ("train", 0, False)]),  # validation's, inside the sanity check, first
        (0, False, [("train", 0, False), ("val", 0, False)]),  # validation's at the first validation
        (2, True, [("train", 0, False), ("val", 0, True)]),  # configure_optimizers needs the training data
    ],
)
def test_loaders_are_asked_for_when_first_needed(sanity_steps: int, steps_in_configure: bool, calls: Any) -> None:
    model = _Recording(steps_in_configure)
    trainer = quiet_trainer(max_epochs=1, logger=False, enable_checkpointing=False, num_sanity_val_steps=sanity_steps)
    trainer.fit(model)
    assert model.calls == calls


def test_a_stage_its_limit_turns_off_never_asks_for_its_loaders() -> None:
    model = _Recording()
    flags = dict(max_epochs=1, logger=False, enable_checkpointing=False, num_sanity_val_steps=2)
    quiet_trainer(limit_train_batches=0, **flags).fit(model)
    trainer = quiet_trainer(logger=False, limit_val_batches=0)
    assert trainer.validate(model, verbose=False) == [] and trainer.num_val_batches == []
    assert model.calls == [("val", 0, True)]  # the sanity check's, as in Lightning: the training loader is not made


def test_validation_loaders_are_reloaded_at_the_validations_due() -> None:
    model = _Recording()
    trainer = quiet_trainer(max_epochs=9, logger=False, enable_checkpointing=False, num_sanity_val_steps=1,
                            check_val_every_n_epoch=3, reload_dataloaders_every_n_epochs=4)  # fmt: skip
    trainer.fit(model)
    assert [call[:2] for call in model.calls if call[0] == "train"] == [("train", 0), ("train", 4), ("train", 8)]
    # The sanity check's loaders serve epoch 2's validation (epoch 0 validates not), which asks again at 8.
    assert [call for call in model.calls if call[0] == "val"] == [("val", 0, True), ("val", 2, False),
                                                                  ("val", 8, False)]  # fmt: skip


def test_the_sanity_check_leaves_the_random_generators_as_they_were() -> None:
    class Drawing(Regressor):
        def __init__(self) -> None:
            super().__init__()
            self.drawn: list[float] = []

        def validation_step(self, batch: Any, batch_idx: int) -> None:
            torch.rand(3)  # as a random augmentation would

        def on_train_start(self) -> None:
            self.drawn.append(torch.rand(1).item())

    runs = []
    for sanity_steps in (0, 2):
        torch.manual_seed(4)
        model = Drawing()
        quiet_trainer(max_epochs=1, logger=False, enable_checkpointing=False, num_sanity_val_steps=sanity_steps).fit(
            model, make_loader(16), make_loader(16)
        )
        runs.append(model.drawn)
    assert runs[0] == runs[1]


# --------------------------------------------------------------------------- validation on a clock
@pytest.mark.parametrize("interval", [timedelta(seconds=3), {"seconds": 3}, "00:00:00:03"])
def test_a_duration_validates_when_that_much_time_has_passed(
    interval: Any, monkeypatch: pytest.MonkeyPatch
) -> None:  # fmt: skip
    clock = [0.0]
    monkeypatch.setattr(training_data, "time", SimpleNamespace(monotonic=lambda: clock[0]))

    class OneSecondBatches(Regressor):
        def __init__(self) -> None:
            super().__init__()
            self.validated_at: list[int] = []

        def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
            clock[0] += 1.0

        def on_validation_epoch_start(self) -> None:
            self.validated_at.append(self.global_step)

    model = OneSecondBatches()
    trainer = quiet_trainer(max_epochs=1, logger=False, enable_checkpointing=False, num_sanity_val_steps=0,
                            val_check_interval=interval)  # fmt: skip
    trainer.fit(model, make_loader(32, batch_size=4), make_loader(8))  # 8 batches, 1 s each
    assert model.validated_at == [3, 6]  # the time counts again from each validation; none at the epoch's end


def test_a_wrong_duration_is_refused_with_the_forms_it_takes() -> None:
    with pytest.raises(ValueError, match="val_check_interval='3s': expected 'DD:HH:MM:SS', a datetime.timedelta"):
        ember.Trainer(val_check_interval="3s")


# --------------------------------------------------------------------------- lengths, and loaders with no batches
class _Stream(torch.utils.data.IterableDataset):
    """Yields ``per_epoch(epoch)`` samples in each epoch of the module that ``epoch_of`` reads."""

    def __init__(self, epoch_of: Any, per_epoch: Any, length: int | None = None) -> None:
        self.epoch_of, self.per_epoch, self.length = epoch_of, per_epoch, length

    def __iter__(self) -> Iterator[Any]:
        return iter(make_data(self.per_epoch(self.epoch_of())))

    def __len__(self) -> int:
        if self.length is None:
            raise TypeError("no length")
        return self.length


def test_lengths_are_checked_as_lightnings_utilities_check_them() -> None:
    with served_by_ember():
        from lightning.pytorch.utilities.data import has_iterable_dataset, has_len_all_ranks
        from lightning_fabric.utilities.data import has_iterable_dataset as from_fabric
    trainer = quiet_trainer()
    sized = DataLoader(_Stream(lambda: 0, lambda epoch: 16, length=16), batch_size=4)
    with pytest.warns(UserWarning, match="Your `IterableDataset` has `__len__` defined"):
        assert has_len_all_ranks(sized, trainer.strategy) and has_iterable_dataset(sized)
    assert from_fabric is has_iterable_dataset
    assert not has_len_all_ranks(DataLoader(_Stream(lambda: 0, lambda epoch: 16), batch_size=4), trainer.strategy)
    with pytest.warns(UserWarning, match="Total length of `DataLoader` across ranks is zero"):
        assert has_len_all_ranks(make_loader(0), trainer.strategy) and not has_iterable_dataset(make_loader(0))


def test_the_batch_size_is_inferred_as_lightnings_utility_infers_it() -> None:
    with served_by_ember():
        from lightning.pytorch.utilities.data import extract_batch_size
    assert extract_batch_size(torch.zeros(7, 3)) == 7 and extract_batch_size(torch.tensor(2.0)) == 1
    assert extract_batch_size({"x": ["id", torch.zeros(5, 2)], "y": torch.zeros(5)}) == 5  # the first tensor's
    with pytest.warns(UserWarning, match="ambiguous collection. The batch size we found is 3"):
        assert extract_batch_size([torch.zeros(3, 2), torch.zeros(4)]) == 3
    for batch in ("text", None, [1.0, 2.0]):
        with pytest.raises(MisconfigurationException, match="We could not infer the batch_size from the batch"):
            extract_batch_size(batch)


def test_every_stage_warns_of_an_iterable_dataset_with_a_length() -> None:
    class Predicting(Regressor):
        def predict_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            return self(batch[0])

    loader = DataLoader(_Stream(lambda: 0, lambda epoch: 16, length=16), batch_size=4)
    trainer = quiet_trainer(max_steps=2, logger=False, enable_checkpointing=False)
    stages = (lambda: trainer.fit(Regressor(), loader), lambda: trainer.validate(Regressor(), loader),
              lambda: trainer.test(Regressor(), [loader]), lambda: trainer.predict(Predicting(), loader))  # fmt: skip
    for run in stages:
        with pytest.warns(UserWarning, match="Your `IterableDataset` has `__len__` defined"):
            run()


@pytest.mark.parametrize("yields_first", [False, True])
def test_an_epoch_whose_loader_yields_nothing_trains_nothing_and_counts(yields_first: bool) -> None:
    epochs_started: list[int] = []

    class Counting(Regressor):
        def on_train_epoch_start(self) -> None:
            epochs_started.append(self.current_epoch)

    model = Counting()
    loader = DataLoader(_Stream(lambda: model.current_epoch, lambda epoch: 8 if yields_first and epoch == 0 else 0),
                        batch_size=4)  # fmt: skip
    trainer = quiet_trainer(max_epochs=3, logger=False, enable_checkpointing=False)
    with pytest.warns(PossibleUserWarning, match=r"yielded no batches in epoch \d: the epoch trains nothing"):
        trainer.fit(model, loader)
    assert trainer.global_step == 2 * yields_first and trainer.current_epoch == 3 and epochs_started == [0, 1, 2]


def test_without_a_limit_on_epochs_fit_ends_at_an_epoch_with_no_batches() -> None:
    model = Regressor()
    loader = DataLoader(_Stream(lambda: model.current_epoch, lambda epoch: 8 if epoch < 2 else 0), batch_size=4)
    trainer = quiet_trainer(max_steps=100, logger=False, enable_checkpointing=False)
    with pytest.warns(PossibleUserWarning, match="no batches in epoch 2: fit ends there, as no limit on epochs"):
        trainer.fit(model, loader)
    assert trainer.global_step == 4 and trainer.current_epoch == 3


def test_an_empty_loader_is_warned_about_and_fit_trains_nothing() -> None:
    trainer = quiet_trainer(max_epochs=2, logger=False, enable_checkpointing=False)
    with pytest.warns(UserWarning, match="Total length of `DataLoader` across ranks is zero"):
        trainer.fit(Regressor(), make_loader(0), make_loader(8))
    assert trainer.global_step == 0 and trainer.current_epoch == 0 and trainer.num_training_batches == 0


@pytest.mark.parametrize(("flags", "warned"), [
    ({"log_every_n_steps": 9}, True), ({"log_every_n_steps": 8}, False), ({"limit_train_batches": 2}, True),
    ({"logger": False}, False), ({"fast_dev_run": 3}, False),
])  # fmt: skip
def test_fewer_batches_than_the_logging_interval_are_warned_about(flags: dict[str, Any], warned: bool) -> None:
    trainer = quiet_trainer(**{"max_epochs": 1, "enable_checkpointing": False, "log_every_n_steps": 50, **flags})
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(Regressor(), make_loader(64))
    messages = [str(warning.message) for warning in caught if "than the logging interval" in str(warning.message)]
    batches = flags.get("limit_train_batches", 8)
    assert messages == ([f"The number of training batches ({batches}) is smaller than the logging interval "
                         f"Trainer(log_every_n_steps={trainer.log_every_n_steps}): step values are written less "
                         "often than once an epoch; lower log_every_n_steps to see them every epoch."]
                        if warned else [])  # fmt: skip
    assert trainer.enable_validation is False  # no validation_step's loader was given
