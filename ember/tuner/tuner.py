"""``Tuner``: the batch-size finder and the learning-rate finder.

Both run short trials of training steps on this process's device, outside ``fit`` (no other rank
is involved, so running out of memory cannot leave another rank waiting), and put the module's
weights back afterwards. With several processes the ranks agree on the result (the batch-size
finder's trials hold the memory that the strategy adds in training, such as DDP's gradient buckets).
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Callable, Iterable, Iterator
from itertools import islice
from typing import TYPE_CHECKING, Any, Literal

import torch

from ember._utils import is_out_of_memory
from ember.exceptions import MisconfigurationException
from ember.loops import StepRunner
from ember.loops.hooks import Hooks
from ember.loops.step import takes_batch_idx
from ember.module import DataModule, Module
from ember.optim import parse_optimizers
from ember.rank_zero import announce, rank_zero_warn
from ember.seed import random_state, set_random_state
from ember.tuner.checks import check_lr_find, check_scale_batch_size, check_tuner_data, lowered
from ember.tuner.lr_finder import LRFinder
from ember.tuner.memory import peak_memory

if TYPE_CHECKING:
    from ember.callbacks.progress import ProgressDisplay
    from ember.trainer import Trainer

#: The loaders and the step of each evaluation stage.
_EVALUATION_STEPS = {"validate": ("val", "validation_step"), "test": ("test", "test_step"),
                     "predict": ("predict", "predict_step")}  # fmt: skip
_LR_ATTRIBUTES = ("lr", "learning_rate")


class Tuner:
    """``Tuner(trainer).scale_batch_size(model)`` and ``Tuner(trainer).lr_find(model)``."""

    def __init__(self, trainer: Trainer) -> None:
        self.trainer = trainer

    # ---------------------------------------------------------------------------- batch size
    def scale_batch_size(
        self,
        model: Module,
        train_dataloaders: Iterable | DataModule | None = None,
        val_dataloaders: Iterable | None = None,
        dataloaders: Iterable | None = None,
        datamodule: DataModule | None = None,
        method: Literal["fit", "validate", "test", "predict"] = "fit",
        mode: Literal["power", "binsearch"] = "power",
        init_val: int = 2,
        max_trials: int = 25,
        steps_per_trial: int = 3,
        batch_arg_name: str = "batch_size",
        max_memory: int | None = None,
        lr_scaling: Literal["linear", "sqrt"] | None = None,
        margin: float = 0.05,
        max_val: int = 8192,
    ) -> int | None:
        """The largest batch size that trains without running out of memory; set on the module/datamodule.

        ``mode="power"`` doubles the size until a trial fails (halves it until one fits, from an ``init_val``
        that does not); ``"binsearch"`` then bisects between the
        last size that fit and the first that did not. A trial runs ``steps_per_trial`` optimizer steps.
        ``max_memory`` (bytes) also counts a trial whose peak tensor memory exceeds it as failed: on a
        CPU, where running out of memory is not an error but swapping, it is the budget to give.
        ``lr_scaling`` scales the learning rate with the batch size ("linear": twice the batch, twice
        the LR; "sqrt": by the square root), from the size the module had before. Under ``fast_dev_run`` it
        does nothing: a warning, and None (as Lightning's). As in Lightning, the loaders must come from the module
        or the datamodule (they are built again at each size; a datamodule may be passed where the loaders go), and
        ``method`` says which loader to size, whose steps the trials run: "fit" (training steps) or an evaluation
        ("validate", "test", "predict"). As Lightning's, no size above ``max_val`` is tried, and ``"binsearch"``
        keeps ``margin`` (a fraction) below the largest size that fit, as a safety buffer.
        """
        datamodule = check_tuner_data(train_dataloaders, val_dataloaders, dataloaders, datamodule, method, False)
        if any(given is not None and given is not datamodule for given in (train_dataloaders, val_dataloaders,
                                                                            dataloaders)):  # fmt: skip
            raise MisconfigurationException(
                "The Batch size finder cannot be used with dataloaders passed directly: it builds them again at each "
                "batch size. Define train_dataloader() on the LightningModule or a LightningDataModule instead"
            )
        mode = lowered(mode)
        check_scale_batch_size(mode, lr_scaling, margin, init_val=init_val, max_trials=max_trials,
                                steps_per_trial=steps_per_trial, max_val=max_val)  # fmt: skip
        if self.trainer.fast_dev_run:  # a batch or two: nothing to find
            rank_zero_warn("Skipping batch size scaler since `fast_dev_run` is enabled.")
            return None
        owner = attribute_owner(batch_arg_name, model, datamodule, "batch size")
        warn_duplicate_field(model, batch_arg_name)
        original = _get(owner, batch_arg_name)
        margin = margin if mode == "binsearch" else 0.0  # (as Lightning's: power mode keeps the size that fit)
        args = (model, datamodule, mode == "power", init_val, max_trials, steps_per_trial, batch_arg_name,
                max_memory, max_val, margin)  # fmt: skip
        good = self.trainer.strategy.launch(self._search_batch_size, method, *args)
        _set(owner, batch_arg_name, good)  # here too: the search may have run in processes started for it
        if lr_scaling is not None and original:
            factor = good / original if lr_scaling == "linear" else math.sqrt(good / original)
            lr_owner = attribute_owner(_LR_ATTRIBUTES, model, None, "learning rate")
            name = next(name for name in _LR_ATTRIBUTES if _has(lr_owner, name))
            _set(lr_owner, name, _get(lr_owner, name) * factor)
        return good

    def _search_batch_size(self, method: str, *args: Any) -> int:
        self.trainer.strategy.setup_environment()
        return search_batch_size(self.trainer, *args, stage=method)

    # ------------------------------------------------------------------------ learning rate
    def lr_find(
        self,
        model: Module,
        train_dataloaders: Iterable | DataModule | None = None,
        val_dataloaders: Iterable | None = None,
        dataloaders: Iterable | None = None,
        datamodule: DataModule | None = None,
        method: Literal["fit"] = "fit",
        min_lr: float = 1e-8,
        max_lr: float = 1.0,
        num_training: int = 100,
        mode: Literal["exponential", "linear"] = "exponential",
        early_stop_threshold: float | None = 4.0,
        update_attr: bool = True,
        attr_name: str = "",
    ) -> LRFinder | None:
        """Train ``num_training`` steps with the learning rate rising from ``min_lr`` to ``max_lr``.

        Returns the loss curve with a suggested learning rate (where the loss falls fastest); stops
        early once the loss exceeds ``early_stop_threshold`` times its best. ``update_attr`` sets the
        suggestion as the module's ``lr`` / ``learning_rate`` (attribute or hyperparameter), or as the
        one ``attr_name`` names. Under ``fast_dev_run`` nothing runs: a warning, and None. The steps read
        ``train_dataloaders`` (or a datamodule given there), else the module's or the datamodule's loader, as in
        Lightning; the sweep does not validate (``val_dataloaders`` is taken and not read).
        """
        datamodule = check_tuner_data(train_dataloaders, val_dataloaders, dataloaders, datamodule, method, True)
        given = None if isinstance(train_dataloaders, DataModule) else train_dataloaders
        return find_lr(
            self.trainer, model, datamodule=datamodule, train_dataloaders=given, min_lr=min_lr, max_lr=max_lr,
            num_training=num_training, mode=lowered(mode), early_stop_threshold=early_stop_threshold,
            update_attr=update_attr, attr_name=attr_name,
        )  # fmt: skip


def search_batch_size(
    trainer: Trainer, model: Module, datamodule: DataModule | None, power: bool, init_val: int, max_trials: int,
    steps_per_trial: int, batch_arg_name: str, max_memory: int | None, max_val: int, margin: float,
    *, stage: str = "fit", in_stage: bool = False,
) -> int:  # fmt: skip
    """The largest batch size that fits on every rank (an error if none does), ``margin`` below it. No trial:
    ``init_val``, as Lightning's. The trials run ``stage``'s steps on its loader; ``in_stage``: inside that stage,
    which has attached the module and set the datamodule up (the ``BatchSizeFinder`` callback's search)."""
    owner = attribute_owner(batch_arg_name, model, datamodule, "batch size")
    original = _get(owner, batch_arg_name)
    fits = _Trials(trainer, model, datamodule, steps_per_trial, max_memory, stage=stage, in_stage=in_stage)
    search = (fits, owner, batch_arg_name, power, init_val, max_trials, max_val)
    good, size = _largest_fit(*search) if max_trials else (init_val, init_val)
    # Every rank must fit, and every rank enters the collective, even one that found nothing: it would
    # otherwise leave the others waiting in it until the timeout.
    agreed = int(trainer.strategy.reduce(torch.tensor(float(good)), reduce_op="min"))
    if agreed == 0:
        _set(owner, batch_arg_name, original)
        raise torch.OutOfMemoryError(
            f"scale_batch_size: even {batch_arg_name}={max(size, 1)} does not fit" if good == 0
            else f"scale_batch_size: another process found no {batch_arg_name} that fits"
        )  # fmt: skip
    if max_trials and int(agreed * (1 - margin)) < agreed:
        reduced = max(1, int(agreed * (1 - margin)))
        announce(f"Applying margin of {margin:.1%}, reducing batch size from {agreed} to {reduced}")  # Lightning's
        agreed = reduced
    announce(f"Finished batch size finder, will continue with full run using batch size {agreed}")  # Lightning's
    return agreed


def find_lr(
    trainer: Trainer,
    module: Module,
    *,
    datamodule: DataModule | None = None,
    loader: Iterable | None = None,
    train_dataloaders: Iterable | None = None,
    min_lr: float,
    max_lr: float,
    num_training: int,
    mode: Literal["exponential", "linear"],
    early_stop_threshold: float | None,
    update_attr: bool,
    attr_name: str,
) -> LRFinder | None:
    """The learning-rate sweep of ``Tuner.lr_find`` and of the ``LearningRateFinder`` callback. Outside ``fit`` the
    trials attach the module and read ``train_dataloaders``, else its (or the datamodule's) ``train_dataloader()``;
    inside, ``loader`` is fit's training loader."""
    check_lr_find(mode, min_lr, max_lr, num_training)
    if trainer.fast_dev_run:
        rank_zero_warn("Skipping learning rate finder since `fast_dev_run` is enabled.")  # Lightning's words
        return None
    attribute = _lr_attribute(module, attr_name) if update_attr else None  # missing: fail before any step
    args = (trainer, module, datamodule, loader, train_dataloaders, min_lr, max_lr, num_training, mode,
            early_stop_threshold)  # fmt: skip
    # Outside fit the sweep joins the job's processes, as fit would, started for it if no launcher did (it may
    # run in workers started from inside this process); inside fit it runs on fit's ranks.
    finder = _sweep(*args) if loader is not None else trainer.strategy.launch(_joined_sweep, *args)
    if attribute is not None and finder.suggested_lr is not None:
        _set(module, attribute, finder.suggested_lr)  # here, where the caller's module is
    return finder


def _joined_sweep(trainer: Trainer, *args: Any) -> LRFinder:
    trainer.strategy.setup_environment()
    return _sweep(trainer, *args)


def _sweep(
    trainer: Trainer, module: Module, datamodule: DataModule | None, loader: Iterable | None,
    train_dataloaders: Iterable | None, min_lr: float, max_lr: float, num_training: int, mode: str,
    early_stop_threshold: float | None,
) -> LRFinder:  # fmt: skip
    """The sweep on this rank (the ranks agree on the suggestion)."""

    def lr_at(step: int) -> float:
        fraction = step / max(num_training - 1, 1)
        if mode == "exponential":
            return min_lr * (max_lr / min_lr) ** fraction
        return min_lr + (max_lr - min_lr) * fraction

    finder = LRFinder(mode=mode, min_lr=min_lr, max_lr=max_lr, num_training=num_training)
    trials = _Trials(trainer, module, datamodule, num_training, None, loader, train_dataloaders)
    display = _display(trainer, "lr_find", num_training)

    def record(step: int, optimizer: torch.optim.Optimizer, loss: torch.Tensor | None) -> bool:
        # The sweep reads every loss (a skipped step's is NaN): it stops once they diverge.
        finder.add(lr_at(step), None if loss is None else float(loss.detach()))
        _show_step(display, step + 1, finder)
        if step + 1 < num_training:
            for group in optimizer.param_groups:
                group["lr"] = lr_at(step + 1)
        diverged = early_stop_threshold is not None and loss is not None and finder.diverged(early_stop_threshold)
        # Rank zero's loss decides for every rank: inside fit, the steps of the ranks meet in collectives.
        return not trainer.strategy.broadcast(diverged)

    def start(optimizer: torch.optim.Optimizer) -> None:
        for group in optimizer.param_groups:
            group["lr"] = lr_at(0)

    try:
        trials.run(on_start=start, after_step=record)
    finally:
        if display is not None:
            display.draw(_last_point(finder), [], final=True)
    suggestion = trainer.strategy.broadcast(finder.suggestion())
    finder.suggested_lr = suggestion
    steps = len(finder.results["lr"])
    announce(
        f"lr_find: suggested lr={suggestion:.3g} ({steps} steps)" if suggestion is not None
        else f"lr_find: no suggestion: {steps} steps are too few to find where the loss falls fastest"
    )  # fmt: skip
    return finder


class _Trials:
    """Short runs of training steps on this rank's device, with the module's weights put back after each."""

    def __init__(
        self,
        trainer: Trainer,
        module: Module,
        datamodule: DataModule | None,
        steps: int,
        max_memory: int | None,
        loader: Iterable | None = None,
        train_dataloaders: Iterable | None = None,
        stage: str = "fit",
        in_stage: bool = False,
    ) -> None:
        if not module.automatic_optimization:
            raise MisconfigurationException(
                "the tuner only works with single optimizer automatic optimization, but the module steps its "
                "optimizers itself (automatic_optimization=False)"
            )
        self.trainer, self.module, self.datamodule = trainer, module, datamodule
        self.steps, self.max_memory = steps, max_memory
        # Fit's when the trials run inside it, else the one given, else None: the module's or the datamodule's,
        # built at each trial.
        self.loader = loader if loader is not None else train_dataloaders
        self.dataset_size = math.inf
        self.stage = stage  # whose steps the trials run
        attach = loader is None and not in_stage  # inside a stage, the stage has attached everything
        if attach:
            # Attached as fit attaches them: the module's configure_optimizers may read the Trainer (its
            # estimated_stepping_batches counts the module's or the datamodule's train loader).
            module.trainer = trainer
            trainer.lightning_module, trainer.datamodule = module, datamodule
        # Fit's steps, without its callbacks, schedulers and clipping; the module's own step hooks run as in fit.
        self.hooks = Hooks(trainer, module, [], datamodule)
        if datamodule is not None and attach:
            datamodule.trainer = trainer
            self.hooks.call_datamodule("setup", stage)

    def __call__(self) -> tuple[bool, str]:
        """Whether ``steps`` steps at the current batch size fit in memory (and in ``max_memory``), and the
        trial's outcome in words."""
        started = time.monotonic()
        strategy = self.trainer.strategy
        device = strategy.root_device
        try:
            with peak_memory(device, measure=self.max_memory is not None) as peak:
                # What training holds beyond the trial's own tensors (DDP's gradient buckets) is held here too.
                held = torch.empty(strategy.training_memory(self.module), dtype=torch.uint8, device=device)
                self.run()
                del held
        except RuntimeError as error:  # torch.OutOfMemoryError is one; on a CPU the allocator raises a plain one
            if not is_out_of_memory(error):
                raise
            self.trainer.strategy.release_memory()
            return False, "runs out of memory"
        ran = f"{self.steps} steps in {time.monotonic() - started:.2f} s"
        if self.max_memory is None:
            return True, f"fits, {ran}"
        if peak() > self.max_memory:
            return False, f"peaks at {peak() / 2**20:.1f} MiB, over max_memory ({self.max_memory / 2**20:.1f} MiB)"
        return True, f"fits, {ran}, peak {peak() / 2**20:.1f} MiB"

    def run(
        self,
        on_start: Callable[[torch.optim.Optimizer], None] | None = None,
        after_step: Callable[[int, torch.optim.Optimizer, torch.Tensor | None], bool] | None = None,
    ) -> None:
        with _random_state_kept():
            if self.stage in _EVALUATION_STEPS:
                self._evaluate(*_EVALUATION_STEPS[self.stage])
            else:
                self._run(on_start, after_step)

    def _evaluate(self, kind: str, step: str) -> None:
        """``steps`` batches of the stage's loader (of ``kind``: "val", ...) through its ``step``, without
        gradients: an evaluation's trial."""
        hooks, strategy, module = self.hooks, self.trainer.strategy, self.module
        loader = _one_loader(hooks.data_loaders(kind), kind)
        self.dataset_size = len(getattr(loader, "dataset", ())) or math.inf
        strategy.setup_module(module, training=False)
        to_device = hooks.batch_transfer(strategy)
        with_index = takes_batch_idx(getattr(module, step))
        modes = [(submodule, submodule.training) for submodule in module.modules()]
        module.eval()
        try:
            with torch.no_grad(), hooks.scope(step):
                for batch_idx, batch in enumerate(islice(loader, self.steps)):
                    batch = to_device(batch) if to_device is not None else batch
                    strategy.step(step, *((batch, batch_idx) if with_index else (batch,)))
        finally:
            self.trainer.run_metrics.eval.clear()
            for submodule, training in modes:  # (frozen parts left in evaluation mode stay there)
                submodule.train(training)

    def _run(
        self,
        on_start: Callable[[torch.optim.Optimizer], None] | None,
        after_step: Callable[[int, torch.optim.Optimizer, torch.Tensor | None], bool] | None,
    ) -> None:
        module, strategy, hooks = self.module, self.trainer.strategy, self.hooks
        loader = self.loader if self.loader is not None else _train_loader(hooks)
        self.dataset_size = len(getattr(loader, "dataset", ())) or math.inf
        strategy.setup_module(module, training=False)
        weights = {name: tensor.detach().clone() for name, tensor in module.state_dict().items()}
        optimizers, _ = parse_optimizers(hooks.call_module("configure_optimizers"))
        if len(optimizers) != 1:
            raise MisconfigurationException(
                f"the tuner only works with single optimizer training: configure_optimizers() returned "
                f"{len(optimizers)}"
            )
        optimizer = optimizers[0]
        runner = StepRunner(strategy, module, optimizers, hooks=hooks.step_hooks(),
                            before_step_hooks=hooks.implementations("on_before_optimizer_step"))  # fmt: skip
        to_device = hooks.batch_transfer(strategy)
        if on_start is not None:
            on_start(optimizer)
        module.train()
        try:
            with hooks.scope("training_step"):
                for step, batch in enumerate(islice(_endless(loader), self.steps)):
                    result = runner.step(to_device(batch) if to_device is not None else batch, step)
                    if after_step is not None and not after_step(step, optimizer, result.loss):
                        break
        finally:
            module.load_state_dict(weights)
            optimizer.zero_grad(set_to_none=True)
            self.trainer.run_metrics.train.clear()


def _largest_fit(
    fits: _Trials, owner: Any, batch_arg_name: str, power: bool, init_val: int, max_trials: int, max_val: int
) -> tuple[int, int]:
    """The largest batch size that fit (0: none did) and the last size tried. ``power``: the size doubles after a
    trial that fits and halves after one that does not, and the search stops at a size that fits next to one that
    did not, as Lightning's (sizes of ``init_val`` times a power of two); else it bisects between the largest size
    that fit and the smallest that did not."""
    good, bad = 0, 0  # the largest size that fit, the smallest that did not (0: none yet)
    size = min(init_val, max_val)
    for trial in range(1, max_trials + 1):
        _set(owner, batch_arg_name, size)
        fit, outcome = fits()
        tried = size
        if fit:
            good = size
            largest = min(fits.dataset_size, max_val)  # (the data set's size is known once a trial ran)
            # Nothing larger to try once a batch holds the whole data set (or max_val is reached).
            size = tried if size >= largest else int(min(size * 2, largest)) if power or not bad else (good + bad) // 2
        else:
            bad = size
            size = tried if power and good else (good + bad) // 2 if good else size // 2
        done = trial == max_trials or size < 1 or size in (good, bad)  # converged (or nothing fits)
        _announce_trial(trial, tried, fit, outcome, None if done else size, fits.dataset_size, max_val)
        if done:
            break
    return good, size


def _announce_trial(trial: int, size: int, fit: bool, outcome: str, following: int | None, dataset_size: float,
                    max_val: int) -> None:  # fmt: skip
    """A trial's line, with Lightning's words first (for code that reads its log)."""
    verb = "succeeded" if fit else "failed"
    announce(f"Batch size {size} {verb}" + (f", trying batch size {following}" if following else "") +
             f" (trial {trial}: {outcome})")  # fmt: skip
    if fit and size >= dataset_size:
        announce(f"The batch size {size} is greater or equal than the length of your dataset: {dataset_size}.")
    elif fit and size >= max_val:
        announce(f"Reached the maximum batch size limit of {max_val}. Stopping search.")


def _display(trainer: Trainer, title: str, total: int) -> ProgressDisplay | None:
    """A progress display for the finder's steps: on the global-zero process, when the Trainer shows progress."""
    bar = trainer.progress_bar_callback
    return bar.display(title, total) if bar is not None and trainer.is_global_zero else None


def _show_step(display: ProgressDisplay | None, steps: int, finder: LRFinder) -> None:
    if display is not None:
        display.count = steps
        if display.due():
            display.draw(_last_point(finder), [])


def _last_point(finder: LRFinder) -> list[str]:
    results = finder.results
    return [f"lr={results['lr'][-1]:.2e}", f"loss={results['loss'][-1]:.4g}"] if results["lr"] else []


@contextlib.contextmanager
def _random_state_kept() -> Iterator[None]:
    """The block may draw random numbers (a loader that makes its data, dropout) that training would draw
    otherwise: the generators are put back as they were, so that trials change neither the run that follows
    nor the next trial."""
    state = random_state()
    try:
        yield
    finally:
        set_random_state(state)


def _endless(loader: Iterable) -> Iterator[Any]:
    """Batches from ``loader``, starting over when it ends (a trial may want more steps than an epoch)."""
    while True:
        empty = True
        for batch in loader:
            empty = False
            yield batch
        if empty:
            raise ValueError("the train dataloader is empty")


def _one_loader(loaders: Any, kind: str) -> Iterable:
    """The one loader of an evaluation (as Lightning's finder, it sizes one)."""
    several = list(loaders.values()) if isinstance(loaders, dict) else loaders
    if not isinstance(several, (list, tuple)):
        return loaders
    if len(several) != 1:
        raise MisconfigurationException(  # Lightning's words first
            f"The Batch size finder cannot be used with multiple {kind} dataloaders: it sizes one loader"
        )
    return several[0]


def _train_loader(hooks: Hooks) -> Iterable:
    loader = hooks.data_loaders("train")
    if loader is not None:
        return loader
    raise MisconfigurationException(
        "`train_dataloader` must be implemented to be used with the tuner: pass train_dataloaders to lr_find, or "
        "define train_dataloader() on the Module or a DataModule (scale_batch_size builds it again at each size)"
    )


# ------------------------------------------------------------------------------ attributes
def _has(owner: Any, name: str) -> bool:
    return name in getattr(owner, "hparams", {}) or hasattr(owner, name)


def _get(owner: Any, name: str) -> Any:
    hparams = getattr(owner, "hparams", {})
    return hparams[name] if name in hparams else getattr(owner, name)


def _set(owner: Any, name: str, value: Any) -> None:
    """Set ``name`` wherever the owner keeps it: a hyperparameter and/or an attribute."""
    hparams = getattr(owner, "hparams", {})
    if name in hparams:
        hparams[name] = value
    if hasattr(owner, name) and not isinstance(getattr(type(owner), name, None), property):
        setattr(owner, name, value)


def _lr_attribute(module: Module, attr_name: str) -> str:
    """The module's attribute or hyperparameter that holds its learning rate: ``attr_name``, else ``lr`` or
    ``learning_rate``."""
    names = (attr_name,) if attr_name else _LR_ATTRIBUTES
    found = next((name for name in names if _has(module, name)), None)
    if found is None:
        raise AttributeError(
            f"lr_find(update_attr=True): the module should have one of these fields: {', '.join(names)} (an "
            "attribute, or a hyperparameter that self.save_hyperparameters() records) that configure_optimizers() "
            "reads; name another with attr_name=..., or pass update_attr=False"
        )
    return found


def warn_duplicate_field(module: Module, name: str) -> None:
    """Warn where the module holds ``name`` both as an attribute and as a hyperparameter (the search sets both)."""
    if name in getattr(module, "hparams", {}) and name in vars(module):
        rank_zero_warn(  # Lightning's words first
            f"Field `model.{name}` and `model.hparams.{name}` are mutually exclusive! The batch size finder sets both "
            f"to the size it finds; keep one of them, read where the loaders are made"
        )


def attribute_owner(names: str | tuple[str, ...], module: Module, datamodule: DataModule | None, what: str) -> Any:
    names = (names,) if isinstance(names, str) else names
    for owner in (datamodule, module):
        if owner is not None and any(_has(owner, name) for name in names):
            return owner
    fields = " or ".join(names)
    raise MisconfigurationException(  # Lightning's exception and first sentence, then what to do
        f"Field {fields} not found in `model`, `datamodule`, nor their `hparams` attributes: no {what} to tune; give "
        "the module or datamodule an attribute or hyperparameter by that name (self.save_hyperparameters() records "
        "it) that its train_dataloader() / configure_optimizers() reads"
    )
