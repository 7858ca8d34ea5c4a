"""``Module`` (the model and its steps) and ``DataModule`` (the data and its loaders)."""

from __future__ import annotations

import contextlib
import functools
import inspect
import os
from collections.abc import Callable, Iterator, Mapping, Sequence
from itertools import chain
from typing import TYPE_CHECKING, Any, BinaryIO, ClassVar, Literal, cast

import torch
from torch.utils.data import DataLoader, Dataset, IterableDataset

from ember import _utils
from ember import checkpoint as checkpoint_io
from ember._utils import sized_len
from ember.checkpoint.state import load_datamodule_state, load_module_state, load_weights
from ember.exceptions import MisconfigurationException
from ember.hparams import HyperparametersMixin, build, class_only_method, init_arguments
from ember.metrics import is_metric_object
from ember.module_export import ExportMixin
from ember.module_hooks import DataHooks, ModuleHooks
from ember.rank_zero import rank_zero_warn, rank_zero_warn_once

if TYPE_CHECKING:
    from ember.loggers import Logger
    from ember.trainer import Trainer


class Module(HyperparametersMixin, ModuleHooks, ExportMixin):
    """A ``torch.nn.Module`` that also says how to train, validate, test and predict with it.

    Define ``training_step(batch, batch_idx)`` (returning the loss, a dict with ``"loss"``, or None
    to skip the batch) and ``configure_optimizers()``; optionally ``validation_step``,
    ``test_step``, ``predict_step``, the ``*_dataloader`` methods, the hooks below and those of
    ``ModuleHooks``. A step may leave out ``batch_idx``.

    A module whose layers you put on different devices yourself (``self.encoder.to("cuda:0");
    self.decoder.to("cuda:1")``) is left where it is; batches go to ``input_device`` if you set it,
    else to the first parameter's device.
    """

    #: The device batches are moved to when the layers were placed by hand (None: the first parameter's).
    input_device: torch.device | str | None = None
    #: False to step optimizers yourself with ``self.optimizers()`` and ``self.manual_backward`` (set in ``__init__``
    #: or, as Lightning allows, as a class attribute of the subclass).
    automatic_optimization: bool = True
    #: False to load checkpoints that lack some of the module's weights or hold others (``fit``/``validate``/... with
    #: ``ckpt_path``, and ``load_from_checkpoint``), as Lightning's ``strict_loading``.
    strict_loading: bool = True
    #: What ``torch.jit.script(module)`` leaves out: properties that read the Trainer, which TorchScript cannot compile.
    __jit_unused_properties__: ClassVar[list[str]] = [
        "trainer", "device", "on_gpu", "current_epoch", "global_step", "global_rank", "local_rank", "dtype", "logger",
        "loggers", "hparams", "hparams_initial", "hparams_for_logger",
    ]  # fmt: skip

    if TYPE_CHECKING:
        # Module defines neither: fit refuses a module without configure_optimizers by name (Lightning's default
        # returns None), and the pipeline strategy asks for pipeline_loss. Declared for the type checker only.
        def configure_optimizers(self) -> Any: ...
        def pipeline_loss(self, output: Any, target: Any) -> torch.Tensor: ...

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._trainer: Trainer | None = None

    # --------------------------------------------------------------------------- the trainer
    @property
    def trainer(self) -> Trainer:
        if self._trainer is None and not _utils.graph_traces:
            raise RuntimeError(f"{type(self).__name__} is not attached to a `Trainer`.")
        return self._trainer  # type: ignore[return-value]  # None only while a graph is traced

    @trainer.setter
    def trainer(self, trainer: Trainer | None) -> None:
        """Attach the module, and the modules it holds (an ensemble's members), to ``trainer``."""
        for child in self.children():
            if isinstance(child, Module):
                child.trainer = trainer
        self._trainer = trainer

    @property
    def device(self) -> torch.device:
        if self._trainer is not None:
            return self._trainer.strategy.root_device
        for tensor in chain(self.parameters(), self.buffers()):
            return tensor.device
        return torch.device("cpu")

    @property
    def current_epoch(self) -> int:
        return self._trainer.current_epoch if self._trainer is not None else 0

    @property
    def global_step(self) -> int:
        return self._trainer.global_step if self._trainer is not None else 0

    @property
    def global_rank(self) -> int:
        return self._trainer.global_rank if self._trainer is not None else 0

    @property
    def local_rank(self) -> int:
        return self._trainer.local_rank if self._trainer is not None else 0

    @property
    def dtype(self) -> torch.dtype:
        """The dtype of the module's floating-point parameters (and buffers): float32 unless converted."""
        for tensor in chain(self.parameters(), self.buffers()):
            if tensor.is_floating_point():
                return tensor.dtype
        return torch.get_default_dtype()

    @property
    def logger(self) -> Logger | None:
        """The Trainer's first logger (None outside a Trainer or without loggers)."""
        return self._trainer.logger if self._trainer is not None else None

    @property
    def loggers(self) -> list[Logger]:
        return self._trainer.loggers if self._trainer is not None else []

    def __getstate__(self) -> dict[str, Any]:
        # Copies and pickles of the module (EMA copies, spawned workers) must not drag the Trainer along.
        state = self.__dict__.copy()
        state["_trainer"] = None
        return state

    # -------------------------------------------------------------------------------- logging
    def log(
        self,
        name: str,
        value: Any,
        prog_bar: bool = False,
        logger: bool | None = None,
        on_step: bool | None = None,
        on_epoch: bool | None = None,
        reduce_fx: str | Callable[..., Any] = "mean",
        enable_graph: bool = False,
        sync_dist: bool = False,
        sync_dist_group: Any = None,
        add_dataloader_idx: bool = True,
        batch_size: int | None = None,
        metric_attribute: str | None = None,
        rank_zero_only: bool = False,
    ) -> None:
        """Log a number, a one-element tensor or a torchmetrics ``Metric`` under ``name``.

        In ``training_step`` values are logged per step by default, elsewhere per epoch (the
        batch-size-weighted mean unless ``reduce_fx`` says otherwise: "mean", "sum", "max", "min" or the
        functions ``torch.mean``, ``max``, ...). Values stay on the device, detached, until a logger writes
        them. ``logger=False`` keeps a value from the loggers (None, the default, is True).
        ``sync_dist=True`` reduces epoch values across ranks. With several evaluation loaders the name gets
        ``/dataloader_idx_N`` unless ``add_dataloader_idx`` is False. ``rank_zero_only=True`` says the call is
        made on global rank zero only (it cannot then be synchronised). A Metric must be an attribute of the
        module (so that it moves and is saved with it), found by itself or named by ``metric_attribute``.
        """
        if enable_graph or sync_dist_group is not None or (rank_zero_only and sync_dist):
            raise ValueError(_unsupported_log_option(name, enable_graph, sync_dist_group))
        trainer = self._trainer
        if trainer is None:  # a step called by hand, as in a unit test: not an error
            rank_zero_warn(
                f"self.log({name!r}, ...) does nothing: the `self.trainer` reference is not registered on the "
                "module yet (the module has not been given to a Trainer)"
            )
        elif trainer.config.barebones:
            rank_zero_warn_once(_barebones_refusal(f"self.log({name!r}, ...)"), stacklevel=2)
        else:
            if type(value) is not torch.Tensor and metric_attribute is None and is_metric_object(value):
                self._check_metric_attribute(name, value)
            trainer.run_metrics.log(name, value, prog_bar, logger, on_step, on_epoch, reduce_fx, sync_dist, batch_size,
                                    add_dataloader_idx)  # fmt: skip

    def _check_metric_attribute(self, name: str, metric: Any) -> None:
        """Refuse a logged Metric that is not one of the module's attributes: it would not move to the module's
        device nor be saved with it."""
        attributes = self.__dict__.get("_metric_attributes")
        if attributes is None or id(metric) not in attributes:  # looked for again when it is new
            attributes = {id(module): key for key, module in self.named_modules() if is_metric_object(module)}
            self.__dict__["_metric_attributes"] = attributes
        if id(metric) in attributes:
            return
        if not attributes:
            fix = "you can fix this by setting an attribute for the metric in your Module (self.accuracy = ...)"
        else:
            fix = (
                f"you can fix this by calling `self.log({name}, ..., metric_attribute=name)` where `name` is one of "
                f"{list(attributes.values())}"
            )
        raise MisconfigurationException(
            f"self.log({name!r}, <{type(metric).__name__}>): the metric is not an attribute of the module, so it "
            f"would neither move to its device nor be saved with it; {fix}"
        )

    def log_dict(self, dictionary: Mapping[str, Any], **options: Any) -> None:
        """``self.log`` for each item of ``dictionary``, with the same options."""
        trainer = self._trainer
        if trainer is not None and trainer.config.barebones:  # one warning for the call, naming it
            rank_zero_warn_once(_barebones_refusal(f"self.log_dict({list(dictionary)!r}, ...)"), stacklevel=2)
            return
        for name, value in dictionary.items():
            self.log(name, value, **options)

    def print(self, *args: Any, **kwargs: Any) -> None:
        """Print from the global-zero process only."""
        if self._trainer is not None:
            self._trainer.print(*args, **kwargs)
        else:
            print(*args, **kwargs)

    # ------------------------------------------------------------------ manual optimization
    def optimizers(self, use_pl_optimizer: bool = True) -> Any:
        """The optimizer (or list of them) from ``configure_optimizers``, wrapped so that ``step()`` goes through the
        precision, or as it returned them (``use_pl_optimizer=False``, as in Lightning)."""
        loop = self.trainer.fit_loop
        optimizers = loop.lightning_optimizers if use_pl_optimizer else loop.optimizers
        return optimizers[0] if len(optimizers) == 1 else optimizers

    def lr_schedulers(self) -> Any:
        """The scheduler (or list of them) from ``configure_optimizers``, or None."""
        schedulers = [config.scheduler for config in self.trainer.lr_scheduler_configs]
        if not schedulers:
            return None
        return schedulers[0] if len(schedulers) == 1 else schedulers

    def toggle_optimizer(self, optimizer: Any) -> None:
        """Let only ``optimizer``'s parameters receive gradients: every other optimizer's parameters are
        frozen until ``untoggle_optimizer`` gives each back the ``requires_grad`` it had."""
        optimizer = getattr(optimizer, "optimizer", optimizer)  # what self.optimizers() returns wraps it
        saved: dict[torch.Tensor, bool] = {}
        for other in self.trainer.optimizers:
            for parameter in _parameters_of(other):
                saved.setdefault(parameter, parameter.requires_grad)
                parameter.requires_grad_(False)
        for parameter in _parameters_of(optimizer):
            parameter.requires_grad_(saved[parameter])
        self._toggled_requires_grad = saved

    def untoggle_optimizer(self, optimizer: Any) -> None:
        """Undo ``toggle_optimizer``: the other optimizers' parameters get back the ``requires_grad`` they had;
        ``optimizer``'s keep theirs (as a ``toggled_optimizer`` block left them), as in Lightning."""
        optimizer = getattr(optimizer, "optimizer", optimizer)
        saved = getattr(self, "_toggled_requires_grad", {})
        others = [other for other in self.trainer.optimizers if other is not optimizer]
        for parameter in chain.from_iterable(_parameters_of(other) for other in others):
            parameter.requires_grad_(saved.get(parameter, parameter.requires_grad))
        self._toggled_requires_grad = {}

    @contextlib.contextmanager
    def toggled_optimizer(self, optimizer: Any) -> Iterator[None]:
        """``toggle_optimizer`` for the duration of a ``with`` block."""
        self.toggle_optimizer(optimizer)
        try:
            yield
        finally:
            self.untoggle_optimizer(optimizer)

    def all_gather(self, data: Any, group: Any = None, sync_grads: bool = False) -> Any:
        """Every process's ``data`` (tensors, numbers, or dicts and lists of them) stacked along a new first
        dimension, one entry per process; on one process, ``data`` as tensors. ``sync_grads=True`` lets
        gradients flow back through the gathered tensors to each process's own."""
        if group is not None:
            raise ValueError("all_gather(group=...): Ember gathers from every process; leave group=None")
        strategy = self.trainer.strategy
        device = strategy.root_device

        def gather(value: Any) -> Any:
            if isinstance(value, Mapping):
                return type(value)({key: gather(item) for key, item in value.items()})  # type: ignore[call-arg]
            if isinstance(value, (list, tuple)):
                items = [gather(item) for item in value]
                return type(value)(*items) if hasattr(value, "_fields") else type(value)(items)  # a namedtuple's fields
            if isinstance(value, (torch.Tensor, int, float)) and not isinstance(value, bool):
                tensor = torch.as_tensor(value, device=device)
                return tensor if strategy.world_size == 1 else strategy.all_gather(tensor, sync_grads=sync_grads)
            return value

        return gather(data)

    def manual_backward(self, loss: torch.Tensor, *args: Any, **kwargs: Any) -> None:
        """``loss.backward(*args, **kwargs)`` (``retain_graph=True``, ...) as the strategy and precision need it (loss
        scaling, gradient sync), between the ``on_before_backward`` and ``on_after_backward`` hooks."""
        if self.automatic_optimization:  # the Trainer's backward would then run on a graph this one freed
            raise MisconfigurationException(
                "to use manual_backward, please disable automatic optimization: set model property "
                "`automatic_optimization` as False"
            )
        self.trainer.fit_loop.manual_backward(loss, *args, **kwargs)

    def clip_gradients(
        self,
        optimizer: torch.optim.Optimizer,
        gradient_clip_val: int | float | None = None,
        gradient_clip_algorithm: Literal["norm", "value"] | None = None,
    ) -> None:
        """Clip the gradients of ``optimizer``'s parameters (unscaled first under 16-bit mixed precision) to
        ``gradient_clip_val``, by ``gradient_clip_algorithm`` ("norm" by default): each is the Trainer's flag when
        not given, and an error when it differs from a flag that was given. Nothing to do without a value."""
        config = self.trainer.config
        clip_val = _one_of("gradient_clip_val", config.gradient_clip_val, gradient_clip_val)
        given = gradient_clip_algorithm.lower() if isinstance(gradient_clip_algorithm, str) else None  # any case
        algorithm = _one_of("gradient_clip_algorithm", config.gradient_clip_algorithm, given)
        if algorithm not in (None, "norm", "value"):
            raise MisconfigurationException(
                f"`gradient_clip_algorithm` {algorithm} is invalid. Allowed algorithms: ['value', 'norm'] "
                f"(clip_gradients(gradient_clip_algorithm={algorithm!r}))"
            )
        if not clip_val:
            return
        strategy = self.trainer.strategy
        optimizer = getattr(optimizer, "optimizer", optimizer)
        strategy.unscale_gradients(optimizer)
        strategy.clip_gradients(optimizer, clip_val, algorithm or "norm")

    # ---------------------------------------------------------------------------- the steps
    # A stage runs the steps a module overrides: fit refuses a module without ``training_step``, and validation
    # runs only where ``validation_step`` is overridden. The defaults are Lightning's, for code that calls them.
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        """The loss of a batch (a tensor, a dict with ``"loss"``, or None to skip the batch)."""
        rank_zero_warn("`training_step` must be implemented to be used with the Trainer")

    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        """Evaluate a validation batch (``self.log`` what it measures)."""

    def test_step(self, *args: Any, **kwargs: Any) -> Any:
        """Evaluate a test batch, as ``validation_step``."""

    def predict_step(self, batch: Any, batch_idx: int, dataloader_idx: int = 0) -> Any:
        """By default, the forward pass on the batch."""
        return self(batch)

    # ------------------------------------------------------------------------------- hooks
    def setup(self, stage: str) -> None:
        """Called at the start of fit, validate, test and predict, on every process."""

    def teardown(self, stage: str) -> None:
        """Called at the end of fit, validate, test and predict."""

    def configure_model(self, device_mesh: Any = None) -> None:
        """Lay the model out over ``device_mesh`` (a ``torch.distributed.device_mesh.DeviceMesh``).

        Lightning's form, an override without ``device_mesh``, is called when each stage starts (create layers
        there); this default does nothing, so ``super().configure_model()`` works in either form.

        Called once, before the optimizers are built, by strategies that arrange ranks in a mesh
        (``strategy="model_parallel"``: dimensions ``"data"`` and ``"tensor"``). Apply tensor parallel
        plans here with ``device_mesh["tensor"]`` (see ``ember.strategies.parallelize_transformer``) and
        ``fully_shard`` with ``device_mesh["data"]``. Layers created here, or in ``__init__`` under
        ``torch.device("meta")``, are allocated on the device afterwards and initialised with their
        ``reset_parameters()``.
        """

    def on_fit_start(self) -> None: ...
    def on_fit_end(self) -> None: ...
    def on_train_start(self) -> None: ...
    def on_train_end(self) -> None: ...
    def on_train_epoch_start(self) -> None: ...
    def on_train_epoch_end(self) -> None: ...
    def on_validation_epoch_start(self) -> None: ...
    def on_validation_epoch_end(self) -> None: ...
    def on_test_epoch_start(self) -> None: ...
    def on_test_epoch_end(self) -> None: ...
    def on_predict_epoch_start(self) -> None: ...
    def on_predict_epoch_end(self) -> None: ...

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> int | None:
        """Return -1 to skip the rest of this epoch."""
        return None

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None: ...

    def on_before_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        """Called with gradients accumulated and unscaled, before clipping and the step."""

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        """Add to or change the checkpoint before it is written."""

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        """Read what ``on_save_checkpoint`` added, before the state is restored."""

    # -------------------------------------------------------------------------- checkpoints
    @class_only_method
    def load_from_checkpoint(
        cls,
        checkpoint_path: str | os.PathLike | BinaryIO,
        map_location: Any = "cpu",
        hparams_file: str | None = None,
        strict: bool | None = None,
        weights_only: bool = True,
        **init_overrides: Any,
    ) -> Module:
        """Build the module from the hyperparameters saved in a checkpoint (updated from ``hparams_file``, a YAML
        file, if given) and load its weights."""
        checkpoint = checkpoint_io.load(checkpoint_path, map_location, trust_pickles=not weights_only)
        # Lightning's releases before 0.8 saved the hyperparameters under the older keys.
        arguments = init_arguments(
            cls, checkpoint, init_overrides, "module_arguments", "hparams", hparams_file=hparams_file
        )
        module = build(cls, arguments)
        strict = _strictness(module, strict)
        module.on_load_checkpoint(checkpoint)
        load_weights(functools.partial(load_module_state, module, strict=strict), module, checkpoint, checkpoint_path)
        return module


def _barebones_refusal(call: str) -> str:
    return (
        f"{call} does nothing: `Trainer(barebones=True)` is configured, which turns logging off (it can impact raw "
        "speed)"
    )


def _unsupported_log_option(name: str, enable_graph: bool, sync_dist_group: Any) -> str:
    if enable_graph:
        return f"self.log({name!r}, enable_graph=True): logged values never keep the autograd graph in Ember"
    if sync_dist_group is not None:
        return f"self.log({name!r}, sync_dist_group=...): sync_dist reduces over all processes; leave the group out"
    return f"self.log({name!r}, rank_zero_only=True, sync_dist=True): a value logged on one process cannot be synced"


def _strictness(module: Module, strict: bool | None) -> bool:
    """``load_from_checkpoint``'s ``strict``: the module's ``strict_loading`` unless given; refused, in Lightning's
    words, where the module set ``strict_loading`` itself to another value."""
    if strict is None:
        return module.strict_loading
    owners = [owner for owner in (module, *type(module).__mro__) if owner is not Module]
    if strict != module.strict_loading and any("strict_loading" in vars(owner) for owner in owners):
        raise ValueError(f"You set `.load_from_checkpoint(..., strict={strict!r})` which is in conflict with "
                         f"`{type(module).__name__}.strict_loading={module.strict_loading!r}. Please set the same "
                         "value for both of them.")  # fmt: skip
    return strict


def _one_of(flag: str, trainer_value: Any, given: Any) -> Any:
    """A ``clip_gradients`` argument: ``given``, else the Trainer's flag; both, when they differ, is an error."""
    if given is None:
        return trainer_value
    if trainer_value is not None and given != trainer_value:
        raise MisconfigurationException(
            f"You have set `Trainer({flag}={trainer_value!r})` and have passed `clip_gradients({flag}={given!r})`: "
            "use only one of them"
        )
    return given


def _parameters_of(optimizer: torch.optim.Optimizer) -> Iterator[torch.Tensor]:
    return (parameter for group in optimizer.param_groups for parameter in group["params"])


class DataModule(HyperparametersMixin, DataHooks):
    """The data side of a run: download once (``prepare_data``), build datasets (``setup``), hand out loaders.

    Define any of ``train_dataloader``, ``val_dataloader``, ``test_dataloader`` and ``predict_dataloader``.
    """

    CHECKPOINT_HYPER_PARAMS_KEY = "datamodule_hyper_parameters"
    CHECKPOINT_HYPER_PARAMS_NAME = "datamodule_hparams_name"

    def __init__(self) -> None:
        self.trainer: Trainer | None = None

    def prepare_data(self) -> None:
        """Called once per machine (on local rank zero) before ``setup``: download, tokenize to disk."""

    def setup(self, stage: str) -> None:
        """Called on every process with "fit", "validate", "test" or "predict"."""

    def teardown(self, stage: str) -> None:
        """Called at the end of each stage."""

    def on_exception(self, exception: BaseException) -> None:
        """Called when the stage in progress fails with ``exception`` (after the callbacks' ``on_exception``)."""

    def state_dict(self) -> dict[str, Any]:
        """What the data module needs to resume; saved in checkpoints."""
        return {}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        pass

    def __str__(self) -> str:
        """What each loader hook gives, one line each, in Lightning's form: ``{Train dataloader: size=64}`` (its
        dataset's length, ``NA`` without one; ``1. size=16 ; 2. size=NA`` for several loaders), ``None`` where the
        hook is missing or fails (before ``setup``, say)."""
        lines = []
        for title, hook in _LOADER_TITLES:
            try:
                loaders = getattr(self, hook)()
            except Exception:  # no such hook, or one that cannot run yet
                lines.append(f"{{{title}: None}}")
                continue
            if isinstance(loaders, Mapping):
                loaders = list(loaders.values())
            if isinstance(loaders, Sequence):
                sizes = " ; ".join(f"{index}. size={_dataset_size(each)}" for index, each in enumerate(loaders, 1))
            else:
                sizes = f"size={_dataset_size(loaders)}"
            lines.append(f"{{{title}: {sizes}}}")
        return "\n".join(lines)

    @class_only_method
    def load_from_checkpoint(
        cls,
        checkpoint_path: str | os.PathLike | BinaryIO,
        map_location: Any = "cpu",
        hparams_file: str | None = None,
        weights_only: bool = True,
        **init_overrides: Any,
    ) -> DataModule:
        """Build the data module from the hyperparameters saved in a checkpoint of a ``fit`` that used it (updated
        from ``hparams_file``, a YAML file, if given), and give it its saved ``state_dict``."""
        checkpoint = checkpoint_io.load(checkpoint_path, map_location, trust_pickles=not weights_only)
        datamodule = build(cls, init_arguments(cls, checkpoint, init_overrides, hparams_file=hparams_file))
        load_datamodule_state(datamodule, checkpoint)
        return datamodule

    @classmethod
    def from_datasets(
        cls,
        train_dataset: Dataset | Sequence[Dataset] | Mapping[str, Dataset] | None = None,
        val_dataset: Dataset | Sequence[Dataset] | Mapping[str, Dataset] | None = None,
        test_dataset: Dataset | Sequence[Dataset] | Mapping[str, Dataset] | None = None,
        predict_dataset: Dataset | Sequence[Dataset] | Mapping[str, Dataset] | None = None,
        batch_size: int = 1,
        num_workers: int = 0,
        **datamodule_kwargs: Any,
    ) -> DataModule:
        """A data module whose loaders read the given datasets (a list or dict of datasets gives several loaders).

        The training loader shuffles (unless its dataset is iterable); the others keep their order. Only the
        loaders of the datasets given exist. ``datamodule_kwargs`` go to the class's ``__init__``, and so do
        ``batch_size`` and ``num_workers`` when it takes them (by name, or with ``**kwargs``), as in Lightning.
        """
        accepted = inspect.signature(cls.__init__).parameters
        takes_any = any(parameter.kind is parameter.VAR_KEYWORD for parameter in accepted.values())
        loading = {name: value for name, value in {"batch_size": batch_size, "num_workers": num_workers}.items()
                   if takes_any or name in accepted}  # fmt: skip
        datamodule = cls(**datamodule_kwargs, **loading)

        def loaders(datasets: Any, shuffle: bool) -> Any:
            """A loader for each dataset, in the collection's shape (a dict of datasets gives a dict of loaders)."""
            if isinstance(datasets, Mapping):
                return {key: loaders(dataset, shuffle) for key, dataset in datasets.items()}
            if isinstance(datasets, (list, tuple)):
                return [loaders(dataset, shuffle) for dataset in datasets]
            dataset = cast(Dataset, datasets)
            shuffle = shuffle and not isinstance(dataset, IterableDataset)
            return DataLoader(dataset, batch_size=batch_size, shuffle=shuffle, num_workers=num_workers)

        given = {"train": (train_dataset, True), "val": (val_dataset, False),
                 "test": (test_dataset, False), "predict": (predict_dataset, False)}  # fmt: skip
        for kind, (datasets, shuffle) in given.items():
            if datasets is not None:
                # Bound per instance: only the loaders of the datasets given exist.
                setattr(datamodule, f"{kind}_dataloader", functools.partial(loaders, datasets, shuffle))
        return datamodule


_LOADER_TITLES = (("Train dataloader", "train_dataloader"), ("Validation dataloader", "val_dataloader"),
                  ("Test dataloader", "test_dataloader"), ("Predict dataloader", "predict_dataloader"))  # fmt: skip


def _dataset_size(loader: Any) -> str:
    size = sized_len(getattr(loader, "dataset", None))
    return "NA" if size is None else str(size)


def data_source(stage: str, loaders: Any, datamodule: DataModule | None, val_loaders: Any = None) -> tuple[Any, Any]:
    """The loaders and the datamodule a stage reads: a DataModule passed where the loaders go is the datamodule.
    Loaders and a datamodule together are refused, as in Lightning: only one of them would be read."""
    if isinstance(loaders, DataModule):
        loaders, datamodule = None, loaders
    if datamodule is not None and (loaders is not None or val_loaders is not None):
        # Lightning's words first, for code that matches them
        given = "`train_dataloader` or `val_dataloaders` to" if stage == "fit" else "both"
        arguments = "datamodule=..." if stage == "fit" else "dataloaders=..., datamodule=..."
        raise MisconfigurationException(f"You cannot pass {given} `trainer.{stage}({arguments})`: a stage reads the "
                                        "loaders of one; pass the loaders or the datamodule")  # fmt: skip
    return loaders, datamodule
