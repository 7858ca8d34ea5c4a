"""``EmberCLI``: a command line for a Module and DataModule, configured by flags and YAML files.

    # train.py
    from ember.cli_lightning import EmberCLI
    EmberCLI(MyModel, MyData)

    python train.py fit --config config.yaml --trainer.max_epochs 5 --model.lr 0.01
    python train.py fit --print_config > config.yaml     # every option, with its default
    python train.py test --config config.yaml --ckpt_path best.ckpt

It follows Lightning's ``LightningCLI``: subcommands ``fit``, ``validate``, ``test`` and ``predict``; the groups
``trainer``, ``model``, ``data``, ``optimizer`` and ``lr_scheduler``; ``class_path``/``init_args`` for any
class (callbacks, loggers, a model chosen on the command line); ``seed_everything``; and ``config.yaml``
saved into the run's directory. Built on jsonargparse: ``pip install 'ember[cli]'``.
"""

from __future__ import annotations

import functools
import importlib
import json
import os
import sys
from collections.abc import Callable, Iterable, Sequence
from typing import Any, TypeVar

import torch

import ember
from ember import checkpoint as checkpoint_io
from ember._utils import is_overridden
from ember.callbacks import Callback
from ember.exceptions import MisconfigurationException
from ember.hparams import CLASS_PATH_KEY, INSTANTIATOR_KEY, given_hyperparameters
from ember.lightning_compat.hook import is_installed as lightning_names_served
from ember.module import DataModule, Module
from ember.rank_zero import rank_zero_warn
from ember.seed import seed_everything

# The command line drives the Trainer from above, as ember.cli does: it reaches it through the package.
Trainer = ember.Trainer

try:
    from jsonargparse import ActionConfigFile, ArgumentParser, Namespace, class_from_function
except ImportError:  # pragma: no cover - depends on the environment
    raise ModuleNotFoundError(
        "EmberCLI needs the jsonargparse package: pip install 'ember[cli]' "
        "(or pip install 'jsonargparse[signatures]>=4.49')"
    ) from None

_T = TypeVar("_T")
#: What ``args`` takes: a list of command-line arguments, a dict of the configuration, or a parsed Namespace.
ArgsType = Sequence[str] | dict[str, Any] | Namespace | None
#: The type of a module's argument that builds its optimizer from its parameters: on the command line,
#: ``--model.optimizer=Adam --model.optimizer.lr=0.01`` gives a function that takes the parameters.
OptimizerCallable = Callable[[Iterable[Any]], torch.optim.Optimizer]
#: The same for a learning-rate scheduler, built from the optimizer.
LRSchedulerCallable = Callable[
    [torch.optim.Optimizer], torch.optim.lr_scheduler.LRScheduler | torch.optim.lr_scheduler.ReduceLROnPlateau
]
#: Each subcommand, and the arguments of the Trainer method of that name that the CLI fills itself.
SUBCOMMANDS: dict[str, set[str]] = {
    "fit": {"model", "train_dataloaders", "val_dataloaders", "datamodule"},
    "validate": {"model", "dataloaders", "datamodule"},
    "test": {"model", "dataloaders", "datamodule"},
    "predict": {"model", "dataloaders", "datamodule"},
}


class ReduceLROnPlateau(torch.optim.lr_scheduler.ReduceLROnPlateau):
    """torch's ``ReduceLROnPlateau`` that also names the metric it watches, for ``--lr_scheduler``."""

    def __init__(self, optimizer: torch.optim.Optimizer, monitor: str, *args: Any, **kwargs: Any) -> None:
        super().__init__(optimizer, *args, **kwargs)
        self.monitor = monitor


# This ReduceLROnPlateau, not torch's, as in Lightning: ``--lr_scheduler ReduceLROnPlateau`` names it alone, and the
# metric it watches comes with it.
_Scheduler = (torch.optim.lr_scheduler.LRScheduler, ReduceLROnPlateau)
#: The schedulers ``--lr_scheduler`` takes, as a tuple, a union and a class (Lightning's names, for annotations).
LRSchedulerTypeTuple = _Scheduler
LRSchedulerTypeUnion = torch.optim.lr_scheduler.LRScheduler | ReduceLROnPlateau
LRSchedulerType = type[torch.optim.lr_scheduler.LRScheduler] | type[ReduceLROnPlateau]


class EmberArgumentParser(ArgumentParser):
    """jsonargparse's parser, with groups for the Trainer, modules, callbacks, optimizers and schedulers."""

    def __init__(
        self, *args: Any, description: str = "Ember command line", env_prefix: str = "PL", default_env: bool = False,
        **kwargs: Any,
    ) -> None:  # fmt: skip
        # With default_env=True the options are read from PL_* variables too (PL_TRAINER__MAX_EPOCHS, PL_CONFIG),
        # Lightning's names, which its programs' launch scripts set.
        super().__init__(*args, description=description, env_prefix=env_prefix, default_env=default_env, **kwargs)
        #: Groups that hold a callback, which the CLI adds to the Trainer's callbacks.
        self.callback_keys: list[str] = []
        #: Groups of optimizers and schedulers: their classes, and the option each goes to ("AUTOMATIC": it
        #: replaces the module's configure_optimizers).
        self.optimizer_groups: dict[str, tuple[type | tuple[type, ...], str]] = {}
        self.scheduler_groups: dict[str, tuple[type | tuple[type, ...], str]] = {}

    def add_lightning_class_args(
        self, cls: type | Callable[..., Any], nested_key: str, subclass_mode: bool = False, required: bool = True
    ) -> list[str]:
        """Options for the arguments of ``cls`` (a Trainer, Module, DataModule or Callback, or a function that
        returns one) under ``nested_key``; with ``subclass_mode``, any subclass chosen with ``--<nested_key>
        class.path``."""
        if callable(cls) and not isinstance(cls, type):
            cls = class_from_function(cls)  # its options are the function's arguments; building it calls it
        if not (isinstance(cls, type) and issubclass(cls, (Trainer, Module, DataModule, Callback))):
            raise MisconfigurationException(
                f"Cannot add arguments from: {cls!r}. Expected a Trainer, Module, DataModule or Callback class, or a "
                "function that returns one (annotated with its return type)"
            )
        if issubclass(cls, Callback):
            self.callback_keys.append(nested_key)
        if subclass_mode:
            return self.add_subclass_arguments(cls, nested_key, fail_untyped=False, required=required)
        instantiate = not issubclass(cls, Trainer)  # the CLI builds the Trainer itself, adding callbacks
        return self.add_class_arguments(cls, nested_key, fail_untyped=False, instantiate=instantiate, sub_configs=True)

    def add_optimizer_args(
        self, optimizer_class: type | tuple[type, ...] = (torch.optim.Optimizer,), nested_key: str = "optimizer",
        link_to: str = "AUTOMATIC",
    ) -> None:  # fmt: skip
        """Options for an optimizer under ``nested_key`` (a tuple of classes: any subclass, by class path)."""
        self._add_optimization_group(optimizer_class, nested_key, "params")
        self.optimizer_groups[nested_key] = (optimizer_class, link_to)

    def add_lr_scheduler_args(
        self, lr_scheduler_class: type | tuple[type, ...] = _Scheduler, nested_key: str = "lr_scheduler",
        link_to: str = "AUTOMATIC",
    ) -> None:  # fmt: skip
        """Options for a learning-rate scheduler under ``nested_key``."""
        self._add_optimization_group(lr_scheduler_class, nested_key, "optimizer")
        self.scheduler_groups[nested_key] = (lr_scheduler_class, link_to)

    def _add_optimization_group(self, cls: type | tuple[type, ...], nested_key: str, skip: str) -> None:
        options: dict[str, Any] = {"instantiate": False, "fail_untyped": False, "skip": {skip}}
        if isinstance(cls, tuple):
            self.add_subclass_arguments(cls, nested_key, required=False, **options)
        else:
            self.add_class_arguments(cls, nested_key, sub_configs=True, **options)


class SaveConfigCallback(Callback):
    """Writes the configuration of the run (``config_filename``) into the run's directory when it starts, on the
    global-zero process, refusing to overwrite one unless ``overwrite``; override ``save_config`` to save it
    elsewhere too."""

    def __init__(self, parser: EmberArgumentParser, config: Namespace, config_filename: str = "config.yaml",
                 overwrite: bool = False, multifile: bool = False, save_to_log_dir: bool = True) -> None:  # fmt: skip
        self.parser = parser
        self.config = config
        self.config_filename = config_filename
        self.overwrite = overwrite
        self.multifile = multifile
        self.save_to_log_dir = save_to_log_dir
        self.already_saved = False
        if not save_to_log_dir and not is_overridden("save_config", self, SaveConfigCallback):
            raise ValueError(
                "`save_to_log_dir=False` only makes sense when subclassing SaveConfigCallback to implement "
                "`save_config` (saving the configuration elsewhere); pass save_config_callback=None to save none"
            )

    def setup(self, trainer: Trainer, pl_module: Module, stage: str) -> None:
        if self.already_saved:
            return
        if self.save_to_log_dir:
            directory = trainer.log_dir or trainer.config.root_dir
            path = os.path.join(directory, self.config_filename)
            exists = trainer.strategy.broadcast(os.path.isfile(path) if trainer.is_global_zero else False)
            if exists and not self.overwrite:
                raise RuntimeError(
                    f"{type(self).__name__} expected {path} to NOT exist. Aborting to avoid overwriting results of a "
                    'previous run: delete it, pass save_config_kwargs={"overwrite": True} to overwrite it, or '
                    "save_config_callback=None to save no configuration"
                )
            if trainer.is_global_zero:
                os.makedirs(directory, exist_ok=True)
                self.parser.save(self.config, path, skip_unset=False, overwrite=True, multifile=self.multifile)
        if trainer.is_global_zero:
            self.save_config(trainer, pl_module, stage)
        self.already_saved = True

    def save_config(self, trainer: Trainer, pl_module: Module, stage: str) -> None:
        """Save the configuration somewhere else as well (called on the global-zero process only)."""


class EmberCLI:
    """Parse the command line (or ``args``), build the module, datamodule and Trainer, and run the subcommand.

    Args:
        model_class: the Module to configure (``--model.*``); None, or ``subclass_mode_model=True``, lets the
            command line choose any Module subclass (``--model path.to.Class``). A function that returns a Module
            (annotated so) is configured by its arguments.
        datamodule_class: the DataModule (``--data.*``), chosen alike with ``subclass_mode_data``.
        save_config_callback: the callback that saves ``config.yaml`` (None: none), with ``save_config_kwargs``.
        trainer_class, trainer_defaults: the Trainer class (or a function that returns a Trainer) and defaults for
            its flags.
        seed_everything_default: the default of ``--seed_everything`` (True: ``seed_everything()``'s seed, drawn at
            random, or 0 in a program that uses Lightning's names; False: none).
        parser_kwargs: options for the parser, or per subcommand (``{"fit": {"default_config_files": [...]}}``);
            ``{"default_env": True}`` reads options from ``PL_*`` variables too (``PL_TRAINER__MAX_EPOCHS``).
        parser_class: the parser's class (an ``EmberArgumentParser``).
        args: the arguments to parse instead of ``sys.argv[1:]`` (a list, or a dict of the configuration).
        run: run a subcommand (True) or only build the objects, for the caller to use (``cli.trainer.fit(...)``).
        auto_configure_optimizers: add ``--optimizer`` and ``--lr_scheduler``, which, when given, replace the
            module's ``configure_optimizers`` (by this class's ``configure_optimizers``).
        load_from_checkpoint_support: the module's and datamodule's ``save_hyperparameters()`` record their
            configuration, so that ``load_from_checkpoint`` rebuilds them as configured (an optimizer given by
            class path, ...).

    A ``--ckpt_path`` whose checkpoint saved the module's hyperparameters configures the module from them, so
    that it is built as the checkpoint's was. Override ``add_arguments_to_parser(parser)`` to add options or
    ``parser.link_arguments``, and the hooks ``before_instantiate_classes``, ``after_instantiate_classes``,
    ``before_fit``, ``after_fit`` (and so on for each subcommand).
    """

    def __init__(
        self,
        model_class: type[Module] | Callable[..., Module] | None = None,
        datamodule_class: type[DataModule] | Callable[..., DataModule] | None = None,
        save_config_callback: type[SaveConfigCallback] | None = SaveConfigCallback,
        save_config_kwargs: dict[str, Any] | None = None,
        trainer_class: type[Trainer] | Callable[..., Trainer] = Trainer,
        trainer_defaults: dict[str, Any] | None = None,
        seed_everything_default: bool | int = True,
        parser_kwargs: dict[str, Any] | None = None,
        parser_class: type[EmberArgumentParser] = EmberArgumentParser,
        subclass_mode_model: bool = False,
        subclass_mode_data: bool = False,
        args: ArgsType = None,
        run: bool = True,
        auto_configure_optimizers: bool = True,
        load_from_checkpoint_support: bool = True,
    ) -> None:
        # As given (None: chosen on the command line, among the subclasses of Module or DataModule).
        self.model_class = model_class
        self.subclass_mode_model = model_class is None or subclass_mode_model
        self.datamodule_class = datamodule_class
        self.subclass_mode_data = datamodule_class is None or subclass_mode_data
        self.save_config_callback = save_config_callback
        self.save_config_kwargs = save_config_kwargs or {}
        self.trainer_class = trainer_class
        self.trainer_defaults = trainer_defaults or {}
        self.seed_everything_default = seed_everything_default
        self.parser_class = parser_class
        self.auto_configure_optimizers = auto_configure_optimizers
        self.load_from_checkpoint_support = load_from_checkpoint_support
        self._subcommand_parsers: dict[str, EmberArgumentParser] = {}
        self._method_arguments: dict[str, list[str]] = {}
        self.parser_kwargs = parser_kwargs or {}
        self.parser = self._build_parser(run, dict(self.parser_kwargs))
        self.config = self._parse(args)
        self.subcommand: str | None = self.config["subcommand"] if run else None
        self._hyperparameters_from_checkpoint()
        self._set_seed()
        self.before_instantiate_classes()
        self.instantiate_classes()
        self.after_instantiate_classes()
        if self.subcommand is not None:
            self._run_subcommand(self.subcommand)

    @staticmethod
    def subcommands() -> dict[str, set[str]]:
        """The subcommands, each with the arguments of its Trainer method that the CLI fills itself."""
        return {subcommand: set(skipped) for subcommand, skipped in SUBCOMMANDS.items()}

    # ------------------------------------------------------------------------------- parser
    def _build_parser(self, run: bool, parser_kwargs: dict[str, Any]) -> EmberArgumentParser:
        subcommands = self.subcommands()
        main_kwargs = {key: value for key, value in parser_kwargs.items() if key not in subcommands}
        parser = self.init_parser(**main_kwargs)
        if not run:
            self._add_arguments(parser)
            return parser
        group = parser.add_subcommands()
        trainer_type = self.trainer_class if isinstance(self.trainer_class, type) else class_from_function(
            self.trainer_class
        )  # fmt: skip
        for subcommand, skipped in subcommands.items():
            method = getattr(trainer_type, subcommand)
            description = (method.__doc__ or "").strip().splitlines()[0] if method.__doc__ else subcommand
            options = {"description": description, **parser_kwargs.get(subcommand, {})}
            subparser = self.init_parser(**options)
            self._add_arguments(subparser)
            self._method_arguments[subcommand] = subparser.add_method_arguments(trainer_type, subcommand, skip=skipped)
            self._subcommand_parsers[subcommand] = subparser
            group.add_subcommand(subcommand, subparser, help=description)
        return parser

    def init_parser(self, **kwargs: Any) -> EmberArgumentParser:
        """A parser with ``--config`` (and, from it, ``--print_config``)."""
        kwargs.setdefault("dump_header", [f"ember=={ember.__version__}"])  # what wrote a saved config
        parser = self.parser_class(**kwargs)
        parser.add_argument("-c", "--config", action=ActionConfigFile, help="a YAML or JSON file of options")
        return parser

    def _add_arguments(self, parser: EmberArgumentParser) -> None:
        parser.add_argument(
            "--seed_everything", type=bool | int, default=self.seed_everything_default,
            help="seed every random generator with this int before building anything (True: seed_everything()'s seed)",
        )  # fmt: skip
        parser.add_lightning_class_args(self.trainer_class, "trainer")
        parser.set_defaults({f"trainer.{key}": value for key, value in self.trainer_defaults.items()
                             if key != "callbacks"})  # fmt: skip
        parser.add_lightning_class_args(self.model_class or Module, "model", subclass_mode=self.subclass_mode_model)
        parser.add_lightning_class_args(
            self.datamodule_class or DataModule, "data", subclass_mode=self.subclass_mode_data,
            required=self.datamodule_class is not None,
        )  # fmt: skip
        self.add_arguments_to_parser(parser)
        if self.auto_configure_optimizers:
            if not parser.optimizer_groups:
                parser.add_optimizer_args()
            if not parser.scheduler_groups:
                parser.add_lr_scheduler_args()
        for key, (group, link_to) in {**parser.optimizer_groups, **parser.scheduler_groups}.items():
            if link_to != "AUTOMATIC":  # the option linked to gets a class path and arguments, for instantiate_class
                compute = None if isinstance(group, tuple) else functools.partial(_class_spec, group)
                parser.link_arguments(key, link_to, compute_fn=compute)

    def add_arguments_to_parser(self, parser: EmberArgumentParser) -> None:
        """Add options or links to ``parser`` (each subcommand's parser gets the same)."""

    def _parse(self, args: ArgsType) -> Namespace:
        if args is not None and len(sys.argv) > 1:
            rank_zero_warn(
                f"{self._name()}'s args parameter is intended to run from within Python like if it were from the "
                "command line. To prevent mistakes it is not recommended to provide both args and command line "
                f"arguments, got: sys.argv[1:]={sys.argv[1:]}, args={args} (args is parsed; the command line is not)",
                stacklevel=5,  # the program's call
            )
        if isinstance(args, (dict, Namespace)):
            return self.parser.parse_object(args)
        return self.parser.parse_args(args)

    def _hyperparameters_from_checkpoint(self) -> None:
        """A ``--ckpt_path`` whose checkpoint saved the module's hyperparameters configures the module from them (over
        the command line's), as in Lightning: the module is then built as the checkpoint's was."""
        path = self.config[self.subcommand].get("ckpt_path") if self.subcommand is not None else None
        if not path or not os.path.isfile(path):  # "best", "last", or none: nothing to read yet
            return
        hparams = dict(checkpoint_io.load(path).get(Module.CHECKPOINT_HYPER_PARAMS_KEY) or {})
        hparams.pop(INSTANTIATOR_KEY, None)
        if not hparams:
            return
        if CLASS_PATH_KEY in hparams:  # the module was chosen by class path
            hparams = {"class_path": hparams.pop(CLASS_PATH_KEY), "dict_kwargs": hparams}
        try:
            self.config = self.parser.parse_object({self.subcommand: {"model": hparams}}, self.config)
        except SystemExit:
            sys.stderr.write(f"the hyperparameters saved in --ckpt_path={path} do not configure the module\n")
            raise

    # --------------------------------------------------------------------------- instances
    def _set_seed(self) -> None:
        seed = self._get(self.config, "seed_everything")
        if seed is False:
            return
        seed = seed_everything(None if seed is True else seed, workers=True)
        self._section(self.config)["seed_everything"] = seed  # the config saved names the seed used

    def before_instantiate_classes(self) -> None:
        """Called after parsing, before the classes are built."""

    def instantiate_classes(self) -> None:
        """Build the datamodule, the module (with the configured optimizer, if any) and the Trainer."""
        instantiators = [
            (_ConfiguredBuilder(self, key), cls, subclass_mode)
            for key, cls, subclass_mode in (
                ("model", self.model_class or Module, self.subclass_mode_model),
                ("data", self.datamodule_class or DataModule, self.subclass_mode_data),
            )
            if self.load_from_checkpoint_support and isinstance(cls, type)
        ]
        self.config_init = self.parser.instantiate(self.config, instantiators=instantiators)
        self.datamodule: DataModule | None = self._get(self.config_init, "data")
        self.model: Module = self._get(self.config_init, "model")
        self._configure_optimizers_from_config()
        self.trainer = self.instantiate_trainer()

    def after_instantiate_classes(self) -> None:
        """Called once the module, datamodule and Trainer exist."""

    def instantiate_trainer(self, **kwargs: Any) -> Trainer:
        """The Trainer of the configuration (``kwargs`` override it), with the callbacks of callback groups, the
        defaults' callbacks and the ``SaveConfigCallback``."""
        parser = self._parser()
        flags = {**self._get(self.config_init, "trainer", {}), **kwargs}
        if "callbacks" not in flags:
            rank_zero_warn(
                f"The `{self.trainer_class.__qualname__}` class does not expose the `callbacks` argument so they will "
                "not be included (the callback groups', trainer_defaults' and the SaveConfigCallback)"
            )
            return self.trainer_class(**flags)
        given = flags.get("callbacks")
        callbacks = [] if given is None else [given] if isinstance(given, Callback) else list(given)
        callbacks += [self._get(self.config_init, key) for key in parser.callback_keys]
        default = self.trainer_defaults.get("callbacks", [])
        callbacks += default if isinstance(default, list) else [default]
        if self.save_config_callback is not None and not flags.get("fast_dev_run", False):
            section = self._section(self.config)
            callbacks.append(self.save_config_callback(parser, section, **self.save_config_kwargs))
        return self.trainer_class(**{**flags, "callbacks": callbacks})

    @staticmethod
    def configure_optimizers(
        lightning_module: Module, optimizer: torch.optim.Optimizer, lr_scheduler: Any | None = None
    ) -> Any:
        """What the module's ``configure_optimizers`` returns when ``--optimizer`` is given: the optimizer and the
        scheduler of ``--lr_scheduler``, if any (a ``ReduceLROnPlateau`` with the metric it watches). Override it
        to return them otherwise (an ``"interval": "step"``, ...)."""
        if lr_scheduler is None:
            return optimizer
        if isinstance(lr_scheduler, ReduceLROnPlateau):
            return {
                "optimizer": optimizer,
                "lr_scheduler": {"scheduler": lr_scheduler, "monitor": lr_scheduler.monitor},
            }
        return [optimizer], [lr_scheduler]

    def _configure_optimizers_from_config(self) -> None:
        """With ``--optimizer`` given, the module's optimizers are the configured optimizer and scheduler."""
        parser = self._parser()
        optimizers = {key: cls for key, (cls, link) in parser.optimizer_groups.items() if link == "AUTOMATIC"}
        schedulers = {key: cls for key, (cls, link) in parser.scheduler_groups.items() if link == "AUTOMATIC"}
        if len(optimizers) > 1 or len(schedulers) > 1:
            raise MisconfigurationException(
                f"`{self._name()}` expects at most one optimizer and one lr_scheduler to be 'AUTOMATIC', but found "
                f"{[*optimizers, *schedulers]}: link the groups to the module's arguments (link_to=...) and build "
                "them in its configure_optimizers"
            )
        optimizer = [(cls, self._get(self.config_init, key)) for key, cls in optimizers.items()]
        if not optimizer or not optimizer[0][1] or self.model is None:
            return
        scheduler = [(cls, spec) for key, cls in schedulers.items() if (spec := self._get(self.config_init, key))]
        model = self.model
        if is_overridden("configure_optimizers", model, Module):
            rank_zero_warn(
                f"`{type(model).__name__}.configure_optimizers` will be overridden by "
                f"`{self._name()}.configure_optimizers`."
            )

        def configure_optimizers() -> Any:  # built when the Trainer asks, from the parameters the module has then
            built = _instantiate(*optimizer[0], model.parameters())
            scheduled = _instantiate(*scheduler[0], built) if scheduler else None
            return self.configure_optimizers(model, built, scheduled)

        model.configure_optimizers = configure_optimizers  # type: ignore[method-assign]

    # ----------------------------------------------------------------------------- running
    def _run_subcommand(self, subcommand: str) -> None:
        before = getattr(self, f"before_{subcommand}", None)
        if callable(before):
            before()
        run = getattr(self, subcommand, getattr(self.trainer, subcommand))
        section = self.config_init[subcommand]
        arguments = {key: section[key] for key in self._method_arguments[subcommand] if key in section}
        if self.datamodule is not None:  # as Lightning: none given, none passed, so a method without one runs
            arguments["datamodule"] = self.datamodule
        run(model=self.model, **arguments)
        after = getattr(self, f"after_{subcommand}", None)
        if callable(after):
            after()

    def _name(self) -> str:
        """How messages name this CLI: Lightning's name in a program that uses Lightning's names."""
        return "LightningCLI" if type(self) is EmberCLI and lightning_names_served() else type(self).__name__

    def _parser(self) -> EmberArgumentParser:
        return self.parser if self.subcommand is None else self._subcommand_parsers[self.subcommand]

    def _section(self, config: Namespace) -> Namespace:
        return config if self.subcommand is None else config[self.subcommand]

    def _get(self, config: Namespace, key: str, default: Any = None) -> Any:
        return self._section(config).get(key, default)


class _ConfiguredBuilder:
    """Builds the module (``key`` "model") or datamodule ("data") with its configuration as the hyperparameters
    its ``save_hyperparameters()`` records, so that ``load_from_checkpoint`` rebuilds it by ``instantiate_module``."""

    def __init__(self, cli: EmberCLI, key: str) -> None:
        self.cli = cli
        self.key = key

    def __call__(self, cls: type[_T], *args: Any, applied_instantiation_links: dict[str, Any], **kwargs: Any) -> _T:
        dumped = self.cli.parser.dump(self.cli.config, skip_link_targets=False, skip_unset=False, format="json")
        hparams = dict(self.cli._section(json.loads(dumped)).get(self.key) or {})
        if "class_path" in hparams:  # chosen by class path: its arguments, with the class under _class_path
            hparams = {CLASS_PATH_KEY: hparams["class_path"], **hparams.get("init_args", {}),
                       **hparams.get("dict_kwargs", {})}  # fmt: skip
        prefix = f"{self.key}."
        for target, value in applied_instantiation_links.items():  # links applied as the objects are built
            if target.startswith(prefix):
                *parents, name = target.removeprefix(prefix).removeprefix("init_args.").split(".")
                holder = hparams
                for parent in parents:
                    holder = holder[parent]
                holder[name] = value
        with given_hyperparameters(cls, hparams, instantiator=_instantiator_name()):
            return cls(*args, **kwargs)


def _instantiator_name() -> str:
    """The name under which hyperparameters record ``instantiate_module``: in a program that uses Lightning's names,
    Lightning's, under the name it imported the CLI by (Ember serves it, and Lightning can load the checkpoint too);
    else Ember's own."""
    served = [root for root in ("lightning.pytorch", "pytorch_lightning") if f"{root}.cli" in sys.modules]
    return (
        f"{served[0]}.cli.instantiate_module"
        if served and lightning_names_served()
        else f"{__name__}.instantiate_module"
    )


def instantiate_module(cls: type[_T], config: dict[str, Any]) -> _T:
    """A ``cls`` built from the configuration that the command line recorded as its hyperparameters: how
    ``load_from_checkpoint`` rebuilds a module or datamodule that ``EmberCLI`` configured. One chosen by class path
    is rebuilt as that class, which must be a ``cls``: ``Module.load_from_checkpoint`` gives the configured model."""
    parser = ArgumentParser(exit_on_error=False)
    arguments: dict[str, Any] = {name: value for name, value in config.items() if name != CLASS_PATH_KEY}
    if CLASS_PATH_KEY in config:
        parser.add_subclass_arguments(cls, "module", fail_untyped=False)
        arguments = {"class_path": config[CLASS_PATH_KEY], "dict_kwargs": arguments}
    else:
        parser.add_class_arguments(cls, "module", fail_untyped=False)
    built: _T = parser.instantiate(parser.parse_object({"module": arguments})).module
    return built


def instantiate_class(args: Any, init: dict[str, Any]) -> Any:
    """The class of ``init["class_path"]`` built with ``args`` (one positional argument, or a tuple of them) and
    ``init["init_args"]``: how a module builds the optimizer that ``add_optimizer_args(link_to=...)`` gives it
    (``instantiate_class(self.parameters(), self.hparams.optimizer_init)``)."""
    module, _, name = init["class_path"].rpartition(".")
    cls = getattr(importlib.import_module(module), name)
    return cls(*(args if isinstance(args, tuple) else (args,)), **dict(init.get("init_args") or {}))


def _class_spec(cls: type, init_args: Namespace | dict[str, Any] | None) -> dict[str, Any]:
    """The class path and arguments of a group of one class, whose options are only the arguments."""
    arguments = init_args.as_dict() if isinstance(init_args, Namespace) else dict(init_args or {})
    return {"class_path": f"{cls.__module__}.{cls.__name__}", "init_args": arguments}


def _instantiate(group: type | tuple[type, ...], spec: Namespace | dict[str, Any], first: Any) -> Any:
    """Build a configured optimizer or scheduler with ``first`` as its first argument (parameters, or the
    optimizer): ``spec`` is ``class_path``/``init_args``, or only the arguments when ``group`` is one class."""
    if isinstance(group, type):
        return instantiate_class(first, _class_spec(group, spec))
    return instantiate_class(first, spec.as_dict() if isinstance(spec, Namespace) else dict(spec))
