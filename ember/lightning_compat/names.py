"""Which Lightning name is which Ember object, and what to use for those Ember does not have.

Keys of ``PYTORCH`` are modules under ``lightning.pytorch`` (the same under ``pytorch_lightning``); each maps
a name to ``"ember.module:attribute"`` (imported when first used) or to a ``Missing`` saying what to use
instead. A module or name that is in none of the tables is not covered either.
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class Missing:
    """A Lightning name Ember does not have, and the closest thing it has."""

    instead: str


Names = dict[str, "str | Missing"]

_PLUGINS = (
    "Ember has no plugins: pick the precision with Trainer(precision=...), the launcher and cluster are found "
    "by themselves (torchelastic, SLURM, MPI), checkpoints are written atomically by the strategy"
)
_LOGGER = "subclass ember.loggers.Logger (log_metrics and log_hyperparams) to write anywhere"
_DEVICES = "Ember runs on CUDA, MPS and CPU devices, not on TPUs"
_ACCELERATORS = ("Accelerator", "CPUAccelerator", "CUDAAccelerator", "MPSAccelerator")

_MODULE: Names = {"LightningModule": "ember.module:Module"}
_DATAMODULE: Names = {"LightningDataModule": "ember.module:DataModule"}
_TRAINER: Names = {"Trainer": "ember.trainer:Trainer"}
_RANK_ZERO: Names = {
    "rank_zero_only": "ember.rank_zero:rank_zero_only",
    "rank_zero_info": "ember.rank_zero:rank_zero_log_info",  # Lightning's logs (Ember's own prints)
    "rank_zero_warn": "ember.rank_zero:rank_zero_warn",
    "rank_zero_debug": "ember.rank_zero:rank_zero_debug",
    "rank_zero_deprecation": "ember.rank_zero:rank_zero_deprecation",
}
_RANK_ZERO_MODULE: Names = {
    **_RANK_ZERO,
    "WarningCache": "ember.rank_zero:WarningCache",
    "LightningDeprecationWarning": "ember.rank_zero:EmberDeprecationWarning",
}
_TYPES: Names = {
    name: f"ember.lightning_compat.extras:{name}"
    for name in (
        "STEP_OUTPUT",
        "OptimizerLRScheduler",
        "TRAIN_DATALOADERS",
        "EVAL_DATALOADERS",
        "LRSchedulerTypeUnion",
        "LRSchedulerPLType",
        "LRSchedulerConfig",
    )
}

_CALLBACKS: Names = {
    **{
        name: f"ember.callbacks:{name}"
        for name in (
            "Callback",
            "ModelCheckpoint",
            "EarlyStopping",
            "GradientAccumulationScheduler",
            "LearningRateMonitor",
            "ModelSummary",
            "DeviceStatsMonitor",
            "Timer",
            "OnExceptionCheckpoint",
            "BaseFinetuning",
            "BackboneFinetuning",
            "BasePredictionWriter",
            "LambdaCallback",
            "StochasticWeightAveraging",
            "TQDMProgressBar",
            "RichProgressBar",
            "SpikeDetection",
            "ModelPruning",
            "WeightAveraging",
            "EMAWeightAveraging",
        )
    },
    # Lightning's ThroughputMonitor logs each stage's counts and rates under its names; Ember's logs TFLOP/s and MFU.
    "ThroughputMonitor": "ember.callbacks:StageThroughputMonitor",
    # Lightning's ProgressBar draws nothing (a base for bars of one's own); Ember's ProgressBar draws.
    "ProgressBar": "ember.callbacks:ProgressBarBase",
    "RichModelSummary": "ember.callbacks:ModelSummary",
    "Checkpoint": "ember.callbacks:ModelCheckpoint",
    "LearningRateFinder": "ember.tuner:LearningRateFinder",
    "BatchSizeFinder": "ember.tuner:BatchSizeFinder",
}

_STRATEGIES: Names = {
    **{
        name: f"ember.strategies:{name}"
        for name in (
            "Strategy",
            "ParallelStrategy",
            "SingleDeviceStrategy",
            "DDPStrategy",
            "FSDPStrategy",
            "ModelParallelStrategy",
        )
    },
    "DeepSpeedStrategy": Missing("use FSDPStrategy, which shards parameters, gradients and optimizer state (ZeRO 3)"),
    "XLAStrategy": Missing("Ember runs on CUDA, MPS and CPU devices, not on TPUs"),
    "SingleDeviceXLAStrategy": Missing("Ember runs on CUDA, MPS and CPU devices, not on TPUs"),
}

_OPTIMIZER_TYPES: Names = {
    name: f"ember.lightning_compat.extras:{name}"
    for name in ("OptimizerLRSchedulerConfig", "OptimizerConfig", "LRSchedulerConfigType")
}

_LOGGERS: Names = {
    "Logger": "ember.loggers:Logger",
    "CSVLogger": "ember.loggers:CSVLogger",
    "TensorBoardLogger": "ember.loggers:TensorBoardLogger",
    "MLFlowLogger": "ember.loggers:MLflowLogger",
    "WandbLogger": "ember.loggers:WandbLogger",
    "CometLogger": Missing(_LOGGER),
    "NeptuneLogger": Missing(_LOGGER),
    "LitLogger": Missing(_LOGGER),
}

_PROFILERS: Names = {
    "Profiler": "ember.profilers:Profiler",
    "SimpleProfiler": "ember.profilers:SimpleProfiler",
    "PyTorchProfiler": "ember.profilers:PyTorchProfiler",
    "PassThroughProfiler": "ember.profilers:PassThroughProfiler",
    "AdvancedProfiler": Missing("use Trainer(profiler='simple') for where the time goes, 'pytorch' for a trace"),
    "XLAProfiler": Missing("Ember runs on CUDA, MPS and CPU devices, not on TPUs"),
}

_UTILITIES: Names = {
    **_RANK_ZERO,
    "grad_norm": "ember.utilities:grad_norm",
    "GradClipAlgorithmType": "ember.utilities:GradClipAlgorithmType",
    "AttributeDict": "ember.utilities:AttributeDict",
    "move_data_to_device": "ember.utilities:move_data_to_device",
    "is_picklable": "ember.utilities:is_picklable",
    "CombinedLoader": "ember.combined_loader:CombinedLoader",
    "measure_flops": "ember.utilities:measure_flops",
    "disable_possible_user_warnings": "ember.rank_zero:disable_possible_user_warnings",
}

_MODEL_SUMMARY: Names = {
    **{name: f"ember.model_summary:{name}" for name in ("LayerSummary", "ModelSummary", "summarize")},
    # the words of the table's cells, which programs compare sizes and rows with
    **{name: f"ember.model_summary:{name}" for name in ("UNKNOWN_SIZE", "NOT_APPLICABLE", "LEFTOVER_PARAMS_NAME")},
    "get_human_readable_count": "ember.model_summary:readable_count",
    "parse_batch_shape": "ember.model_summary:batch_shape",
}

_DEMOS: Names = {
    **{
        name: f"ember.demos:{name}"
        for name in (
            "BoringModel",
            "ManualOptimBoringModel",
            "BoringDataModule",
            "RandomDataset",
            "RandomDictDataset",
            "RandomIterableDataset",
            "Transformer",
            "LightningTransformer",
        )
    },
    "WikiText2": Missing("use a dataset of your own: Ember's demos download nothing"),
    "MNISTDataModule": Missing("use a dataset of your own (sklearn.datasets.load_digits needs no download)"),
}

_CLI: Names = {
    "LightningCLI": "ember.cli_lightning:EmberCLI",
    "SaveConfigCallback": "ember.cli_lightning:SaveConfigCallback",
    "LightningArgumentParser": "ember.cli_lightning:EmberArgumentParser",
    "ReduceLROnPlateau": "ember.cli_lightning:ReduceLROnPlateau",
    "ArgsType": "ember.cli_lightning:ArgsType",
    "OptimizerCallable": "ember.cli_lightning:OptimizerCallable",
    "LRSchedulerCallable": "ember.cli_lightning:LRSchedulerCallable",
    **{
        name: f"ember.cli_lightning:{name}"
        for name in (
            "instantiate_class",
            "instantiate_module",
            "LRSchedulerTypeTuple",
            "LRSchedulerTypeUnion",
            "LRSchedulerType",
        )
    },
}

#: The modules under ``lightning.pytorch`` that Ember serves ("" is ``lightning.pytorch`` itself).
PYTORCH: dict[str, Names] = {
    "": {
        **_MODULE,
        **_DATAMODULE,
        **_TRAINER,
        "Callback": "ember.callbacks:Callback",
        "seed_everything": "ember.seed:seed_everything",
    },
    "core": {**_MODULE, **_DATAMODULE},
    "core.module": _MODULE,
    "core.datamodule": _DATAMODULE,
    "core.mixins": {"HyperparametersMixin": "ember.hparams:HyperparametersMixin"},
    "core.mixins.hparams_mixin": {"HyperparametersMixin": "ember.hparams:HyperparametersMixin"},
    "core.optimizer": {"LightningOptimizer": "ember.optim:LightningOptimizer"},
    "core.saving": {
        **{name: f"ember.loggers.logger:{name}" for name in ("save_hparams_to_yaml", "load_hparams_from_yaml")},
        **{name: f"ember.hparams:{name}" for name in ("save_hparams_to_tags_csv", "load_hparams_from_tags_csv")},
    },
    "trainer": _TRAINER,
    "trainer.trainer": _TRAINER,
    "trainer.states": {
        name: f"ember.trainer_state:{name}" for name in ("TrainerFn", "RunningStage", "TrainerStatus", "TrainerState")
    },
    "callbacks": _CALLBACKS,
    "callbacks.callback": {"Callback": "ember.callbacks:Callback"},
    "callbacks.model_checkpoint": {"ModelCheckpoint": "ember.callbacks:ModelCheckpoint"},
    "callbacks.early_stopping": {name: f"ember.callbacks:{name}" for name in ("EarlyStopping", "EarlyStoppingReason")},
    "callbacks.lr_monitor": {"LearningRateMonitor": "ember.callbacks:LearningRateMonitor"},
    "callbacks.finetuning": {name: f"ember.callbacks:{name}" for name in ("BaseFinetuning", "BackboneFinetuning")},
    "callbacks.prediction_writer": {
        "BasePredictionWriter": "ember.callbacks:BasePredictionWriter",
        "WriteInterval": "ember.callbacks.prediction_writer:WriteInterval",
    },
    "callbacks.lambda_function": {"LambdaCallback": "ember.callbacks:LambdaCallback"},
    "callbacks.weight_averaging": {
        name: f"ember.callbacks:{name}" for name in ("WeightAveraging", "EMAWeightAveraging")
    },
    "callbacks.stochastic_weight_avg": {"StochasticWeightAveraging": "ember.callbacks:StochasticWeightAveraging"},
    "callbacks.gradient_accumulation_scheduler": {
        "GradientAccumulationScheduler": "ember.callbacks:GradientAccumulationScheduler"
    },
    "callbacks.lr_finder": {"LearningRateFinder": "ember.tuner:LearningRateFinder"},
    "callbacks.batch_size_finder": {"BatchSizeFinder": "ember.tuner:BatchSizeFinder"},
    "callbacks.checkpoint": {"Checkpoint": "ember.callbacks:ModelCheckpoint"},
    "callbacks.model_summary": {"ModelSummary": "ember.callbacks:ModelSummary"},
    "callbacks.rich_model_summary": {"RichModelSummary": "ember.callbacks:ModelSummary"},
    "callbacks.device_stats_monitor": {"DeviceStatsMonitor": "ember.callbacks:DeviceStatsMonitor"},
    "callbacks.timer": {"Timer": "ember.callbacks:Timer"},
    "callbacks.spike": {"SpikeDetection": "ember.callbacks:SpikeDetection"},
    "callbacks.pruning": {"ModelPruning": "ember.callbacks:ModelPruning"},
    "callbacks.on_exception_checkpoint": {"OnExceptionCheckpoint": "ember.callbacks:OnExceptionCheckpoint"},
    "callbacks.throughput_monitor": {"ThroughputMonitor": "ember.callbacks:StageThroughputMonitor"},
    "callbacks.progress": {
        "ProgressBar": "ember.callbacks:ProgressBarBase",
        **{name: f"ember.callbacks:{name}" for name in ("TQDMProgressBar", "RichProgressBar")},
    },
    "callbacks.progress.progress_bar": {
        "ProgressBar": "ember.callbacks:ProgressBarBase",
        "get_standard_metrics": "ember.callbacks.progress_base:standard_metrics",
    },
    "callbacks.progress.tqdm_progress": {
        name: f"ember.callbacks.tqdm_progress:{name}" for name in ("TQDMProgressBar", "Tqdm")
    },
    "callbacks.progress.rich_progress": {
        "RichProgressBar": "ember.callbacks:RichProgressBar",
        "RichProgressBarTheme": "ember.callbacks.progress_bars:RichProgressBarTheme",
    },
    "loggers": _LOGGERS,
    "loggers.logger": {
        "Logger": "ember.loggers:Logger",
        "DummyLogger": "ember.loggers:DummyLogger",
        "DummyExperiment": "ember.loggers.dummy:DummyExperiment",
        "rank_zero_experiment": "ember.loggers.dummy:rank_zero_experiment",
    },
    "loggers.csv_logs": {
        "CSVLogger": "ember.loggers:CSVLogger",
        "ExperimentWriter": "ember.loggers.csv_logger:ExperimentWriter",
    },
    "loggers.tensorboard": {"TensorBoardLogger": "ember.loggers:TensorBoardLogger"},
    "loggers.mlflow": {"MLFlowLogger": "ember.loggers:MLflowLogger"},
    "loggers.wandb": {"WandbLogger": "ember.loggers:WandbLogger"},
    "strategies": _STRATEGIES,
    "strategies.strategy": {"Strategy": "ember.strategies:Strategy"},
    "strategies.parallel": {"ParallelStrategy": "ember.strategies:ParallelStrategy"},
    "strategies.single_device": {"SingleDeviceStrategy": "ember.strategies:SingleDeviceStrategy"},
    "strategies.ddp": {"DDPStrategy": "ember.strategies:DDPStrategy"},
    "strategies.fsdp": {"FSDPStrategy": "ember.strategies:FSDPStrategy"},
    "strategies.model_parallel": {"ModelParallelStrategy": "ember.strategies:ModelParallelStrategy"},
    "profilers": _PROFILERS,
    "profilers.profiler": {"Profiler": "ember.profilers:Profiler"},
    "profilers.base": {"PassThroughProfiler": "ember.profilers:PassThroughProfiler"},
    "profilers.simple": {"SimpleProfiler": "ember.profilers:SimpleProfiler"},
    "profilers.pytorch": {"PyTorchProfiler": "ember.profilers:PyTorchProfiler"},
    "tuner": {"Tuner": "ember.tuner:Tuner"},
    "tuner.tuning": {"Tuner": "ember.tuner:Tuner"},
    "utilities": _UTILITIES,
    "utilities.rank_zero": _RANK_ZERO_MODULE,
    "utilities.seed": {"seed_everything": "ember.seed:seed_everything"},
    "utilities.grads": {"grad_norm": "ember.utilities:grad_norm"},
    "utilities.memory": {"recursive_detach": "ember.utilities:recursive_detach"},
    "utilities.parsing": {
        **{name: f"ember.utilities:{name}" for name in ("AttributeDict", "is_picklable")},
        "lightning_hasattr": "ember.hparams:has_field",
        "lightning_getattr": "ember.hparams:get_field",
        "lightning_setattr": "ember.hparams:set_field",
        "clean_namespace": "ember.hparams:drop_unpicklable",
        "parse_class_init_keys": "ember.hparams:init_keys",
        "collect_init_args": "ember.hparams:init_arguments_by_frame",
    },
    "utilities.types": {**_TYPES, **_OPTIMIZER_TYPES},
    "utilities.exceptions": {"MisconfigurationException": "ember.exceptions:MisconfigurationException"},
    "utilities.combined_loader": {"CombinedLoader": "ember.combined_loader:CombinedLoader"},
    "utilities.warnings": {"PossibleUserWarning": "ember.exceptions:PossibleUserWarning"},
    "utilities.data": {
        **{name: f"ember.data:{name}" for name in ("has_len_all_ranks", "has_iterable_dataset")},
        "extract_batch_size": "ember.utilities:extract_batch_size",
    },
    "utilities.model_summary": _MODEL_SUMMARY,
    "utilities.model_summary.model_summary": _MODEL_SUMMARY,
    "cli": _CLI,
    "demos": _DEMOS,
    "demos.boring_classes": {name: value for name, value in _DEMOS.items() if "Transformer" not in name},
    "demos.transformer": {name: _DEMOS[name] for name in ("Transformer", "LightningTransformer", "WikiText2")},
    "plugins": {},
    "accelerators": {
        **{name: f"ember.trainer_properties:{name}" for name in _ACCELERATORS},
        "XLAAccelerator": Missing(_DEVICES),
    },
    "accelerators.accelerator": {"Accelerator": "ember.trainer_properties:Accelerator"},
    **{
        f"accelerators.{module}": {name: f"ember.trainer_properties:{name}"}
        for module, name in (("cpu", "CPUAccelerator"), ("cuda", "CUDAAccelerator"), ("mps", "MPSAccelerator"))
    },
}

_FABRIC = "use ember.Trainer with an ember.Module: Ember has no Fabric"
#: The parts of Lightning Fabric (``lightning_fabric``, the same as ``lightning.fabric``) that Lightning programs import
#: beside ``lightning.pytorch``; Fabric itself is not covered.
#: Modules of ``PYTORCH`` that are Ember's modules themselves rather than tables of their names, so that replacing
#: one of their attributes (``mock.patch("lightning.pytorch.callbacks.progress.tqdm_progress.Tqdm", ...)``, as
#: Lightning's own tests do) reaches the code that uses it.
MODULES: dict[str, str] = {"callbacks.progress.tqdm_progress": "ember.callbacks.tqdm_progress"}

FABRIC: dict[str, Names] = {
    "": {"Fabric": Missing(_FABRIC), "seed_everything": "ember.seed:seed_everything"},
    "utilities": {
        "measure_flops": "ember.utilities:measure_flops",
        "disable_possible_user_warnings": "ember.rank_zero:disable_possible_user_warnings",
        **{name: value for name, value in _RANK_ZERO.items() if name != "rank_zero_debug"},
    },
    "utilities.rank_zero": _RANK_ZERO_MODULE,
    "utilities.seed": {"seed_everything": "ember.seed:seed_everything"},
    "utilities.exceptions": {"MisconfigurationException": "ember.exceptions:MisconfigurationException"},
    "utilities.throughput": {"measure_flops": "ember.utilities:measure_flops"},
    "utilities.warnings": {
        "PossibleUserWarning": "ember.exceptions:PossibleUserWarning",
        "disable_possible_user_warnings": "ember.rank_zero:disable_possible_user_warnings",
    },
    "utilities.spike": {"TrainingSpikeException": "ember.callbacks:TrainingSpikeException"},
    "utilities.data": {"has_iterable_dataset": "ember.data:has_iterable_dataset"},
    "utilities.cloud_io": {
        "get_filesystem": "ember.utilities:get_filesystem",
        "_load": Missing(
            "read a checkpoint with torch.load(path, map_location=..., weights_only=True), a URL's "
            "from get_filesystem(url).open(url, 'rb')"
        ),
    },
}

#: The top-level ``lightning`` package; ``lightning.pytorch`` is served from ``PYTORCH``.
LIGHTNING: Names = {
    **PYTORCH[""],
    "Fabric": Missing(_FABRIC),
}

#: Parts of Lightning Ember leaves out, by module prefix (under lightning.pytorch, or a top-level package), with
#: what to use instead. "plugins" is served empty, so that the message names the class.
MISSING_MODULES = {
    "plugins": _PLUGINS,
    "accelerators.xla": _DEVICES,
    "loggers.wandb": _LOGGER,
    "loggers.comet": _LOGGER,
    "loggers.neptune": _LOGGER,
    "demos.mnist_datamodule": "use a dataset of your own: Ember's demos download nothing",
    "strategies.deepspeed": "use ember.strategies.FSDPStrategy, which shards parameters, gradients and optimizer "
    "state (ZeRO 3)",
    "strategies.xla": _DEVICES,
    "profilers.advanced": "use Trainer(profiler='simple') for where the time goes, 'pytorch' for a trace",
    "loops": "Ember's loops are not replaceable: override the module's hooks, or write a callback",
    "fabric": _FABRIC,
    "lightning_fabric": "use ember.Trainer with an ember.Module: Ember has no Fabric (ember.seed_everything seeds)",
}
