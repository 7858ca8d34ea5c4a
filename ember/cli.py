"""The ``ember`` command (also ``python -m ember``)."""

from __future__ import annotations

import argparse
import importlib.machinery
import importlib.util
import os
import sys
from collections.abc import Sequence
from typing import NoReturn

import ember

_RUN_EPILOG = """\
examples:
  ember run --nproc-per-node 2 train.py --lr 0.1          two processes on this machine
  ember run --nproc-per-node auto train.py                one per GPU (one on a machine without GPUs)
  ember run --nnodes 2 --node-rank 0 --rdzv-endpoint 10.0.0.1:29400 train.py   on node 0 of two
  ember run --nnodes 2 --node-rank 1 --rdzv-endpoint 10.0.0.1:29400 train.py   on node 1
  ember run --nproc-per-node 4 -m mypackage.train         run a module, as python -m does
  ember run --lightning --nproc-per-node 2 train.py       a Lightning script, unchanged, on Ember
  ember run --replica-groups 2 --max-restarts 3 train.py  two fault-tolerant replica groups (pip install 'ember[ft]')

Each worker sees RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT; the script's Trainer
picks them up (devices="auto" becomes the number of processes per node). Unless OMP_NUM_THREADS is set,
the machine's cores are shared among its processes. A traceback a worker writes is cut down to its last
line; each worker's stderr is kept whole under /tmp/torchelastic_*. If any worker fails, the others are
stopped within seconds, and the job ends with the failed rank, its host, its exception and the file with
its traceback; the exit status is that rank's.
"""

_PLOT_EPILOG = """\
examples:
  ember plot ember_logs/version_0                          one run, to curves.png
  ember plot ember_logs -o runs.png                        every run under ember_logs, compared
  ember plot run_a/metrics.csv run_b/metrics.csv --metrics loss,val_acc --x epoch
"""

_CONSOLIDATE_DESCRIPTION = """\
Read the sharded checkpoint DIR (a directory written by strategy="fsdp", "model_parallel" or
"pipeline", each rank its own shard) in one process and write it as the single file OUT: full
tensors, and optimizer states as Optimizer.state_dict() has them. OUT is an ordinary checkpoint:
Trainer.fit(ckpt_path=OUT) resumes from it with any strategy and number of devices, and
Module.load_from_checkpoint(OUT) loads the weights. Needs memory for the whole model.
"""


class _Parser(argparse.ArgumentParser):
    """A parser whose errors (an unknown flag, a missing or malformed value) are one line on stderr, status 2."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: {message} (see {self.prog} --help)\n")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="ember",
        description="Ember: fast PyTorch training with a Lightning-compatible Module and Trainer.",
    )
    parser.add_argument("--version", action="version", version=f"ember {ember.__version__}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")

    run = commands.add_parser(
        "run",
        help="start a training script in several processes (a front for torchrun)",
        description="Start SCRIPT in several processes, on one machine or many, with PyTorch's elastic agent "
        "(torch.distributed.run, the engine behind torchrun).",
        epilog=_RUN_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    run.add_argument(
        "--nproc-per-node", "--nproc_per_node", default="1", metavar="N",
        help="processes to start on this machine: a count, or 'auto' for one per GPU (1 without GPUs); default 1",
    )  # fmt: skip
    run.add_argument("--nnodes", type=int, default=1, metavar="M", help="machines in the job (default 1)")
    run.add_argument(
        "--node-rank", "--node_rank", type=int, default=None, metavar="R",
        help="this machine's index, 0 to M-1; with it, the machines meet at --rdzv-endpoint, which must be "
        "node 0's address. Without it, torchrun's c10d rendezvous assigns node ranks",
    )  # fmt: skip
    run.add_argument(
        "--rdzv-endpoint", "--rdzv_endpoint", default=None, metavar="HOST:PORT",
        help="where the machines of a multi-node job meet (needed when M > 1). A single-machine job listens "
        "on 127.0.0.1 only",
    )  # fmt: skip
    run.add_argument(
        "--rdzv-id", "--rdzv_id", default="ember", metavar="ID",
        help="a name shared by the machines of one job, so that concurrent jobs do not meet (default 'ember')",
    )  # fmt: skip
    run.add_argument(
        "--max-restarts", "--max_restarts", type=int, default=0, metavar="K",
        help="restart all workers up to K times after a failure (default 0)",
    )  # fmt: skip
    run.add_argument(
        "--replica-groups", type=int, default=None, metavar="G",
        help="fault tolerance (torchft): G replica groups of --nproc-per-node processes each, every group its own "
        "torchrun job; a group that fails restarts (--max-restarts) and heals from a live one while the others go "
        "on training. Starts torchft's lighthouse on 127.0.0.1 unless --lighthouse is given",
    )  # fmt: skip
    run.add_argument(
        "--replica-group", type=int, default=None, metavar="I",
        help="with --replica-groups and --lighthouse, on a job spread over machines: start only group I here",
    )  # fmt: skip
    run.add_argument(
        "--lighthouse", default=None, metavar="HOST:PORT",
        help="with --replica-groups: join the lighthouse that runs there (torchft_lighthouse) instead of starting one",
    )  # fmt: skip
    run.add_argument(
        "--lightning", action="store_true",
        help="run a Lightning script unchanged: its imports of lightning, lightning.pytorch and pytorch_lightning "
        "get Ember's classes (see ember.lightning_compat)",
    )  # fmt: skip
    _add_script_arguments(run)
    run.set_defaults(handler=_run)

    doctor = commands.add_parser(
        "doctor",
        help="run a training script for a few steps and report what slows it down",
        description="Run SCRIPT (an Ember script or a hand-written PyTorch loop, unchanged) for a bounded number "
        "of optimizer steps with instrumentation, then report each finding: what was measured, why it costs "
        "time, the fix, and the estimated gain.",
        epilog="examples:\n  ember doctor train.py --lr 0.1\n  ember doctor --json --steps 50 train.py\n"
        "  ember doctor --nproc-per-node 2 train_ddp.py      the checks of distributed training need processes",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    doctor.add_argument(
        "--steps", type=int, default=30, metavar="N",
        help="optimizer steps to run before the report; the first 5 are warm-up and not measured (default 30)",
    )  # fmt: skip
    doctor.add_argument("--json", action="store_true", help="print the report as JSON, for programs")
    doctor.add_argument(
        "--lightning", action="store_true", help="a Lightning script, run with the import hook of ember run --lightning"
    )
    doctor.add_argument(
        "--nproc-per-node", "--nproc_per_node", default="1", metavar="N",
        help="start the script in N processes with ember run (default 1: in this process)",
    )  # fmt: skip
    _add_script_arguments(doctor)
    doctor.set_defaults(handler=_doctor)

    plot = commands.add_parser(
        "plot",
        help="draw the training and validation curves of runs into an image",
        description="Draw the curves in the metrics.csv files of one or several runs (written by CSVLogger, "
        "the default logger), one panel per metric: train_loss, val_loss and loss share the panel 'loss'. "
        "Needs matplotlib (pip install 'ember[plot]').",
        epilog=_PLOT_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    plot.add_argument(
        "runs", nargs="+", metavar="RUN",
        help="a metrics.csv file, a run directory holding one (ember_logs/version_0), or a directory "
        "searched for them (ember_logs: every version)",
    )  # fmt: skip
    plot.add_argument(
        "-o", "--output", default="curves.png", metavar="FILE",
        help="the image to write; its extension picks the format (.png, .svg, .pdf); default curves.png",
    )  # fmt: skip
    plot.add_argument(
        "--metrics", default=None, metavar="A,B",
        help=(
            "comma-separated metrics or panels to draw (default: all); a panel is a metric's name without its "
            "stage prefix and _step/_epoch suffix: 'loss' draws loss, train_loss, val_loss and test_loss"
        ),
    )  # fmt: skip
    plot.add_argument(
        "--x", choices=("step", "epoch"), default="step",
        help="the x axis: the global step (default), or the epoch, with per-step values averaged per epoch",
    )  # fmt: skip
    plot.set_defaults(handler=_plot)

    checkpoint = commands.add_parser(
        "checkpoint",
        help="work with checkpoints (consolidate a sharded one into one file)",
        description="Work with checkpoints.",
    )
    actions = checkpoint.add_subparsers(dest="action", metavar="ACTION", required=True)
    consolidate = actions.add_parser(
        "consolidate",
        help="turn a sharded checkpoint directory into one ordinary checkpoint file",
        description=_CONSOLIDATE_DESCRIPTION,
        epilog="example:\n  ember checkpoint consolidate ember_logs/version_0/checkpoints/last.ckpt model.ckpt",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    consolidate.add_argument("directory", metavar="DIR", help="the sharded checkpoint (a directory)")
    consolidate.add_argument("output", metavar="OUT", help="the file to write, such as model.ckpt")
    consolidate.add_argument(
        "--trust-pickles", action="store_true",
        help="also read values other than tensors and plain Python values (can run code: only for files you trust)",
    )  # fmt: skip
    consolidate.set_defaults(handler=_consolidate)
    return parser


def _add_script_arguments(command: argparse.ArgumentParser) -> None:
    """``[-m] SCRIPT ARGS...``: the training script that ``ember run`` and ``ember doctor`` start."""
    command.add_argument("-m", "--module", action="store_true", help="SCRIPT is a module name, run as python -m SCRIPT")
    command.add_argument("script", metavar="SCRIPT", help="the training script (or module, with -m)")
    arguments = command.add_argument(
        "script_args", nargs=argparse.REMAINDER, metavar="ARGS", help="arguments for the script"
    )
    arguments.required = False  # argparse marks a REMAINDER required, and names it among the missing with SCRIPT


def _run(args: argparse.Namespace) -> int:
    from ember import launch

    module, script, script_args = args.module, args.script, args.script_args
    if args.lightning:  # each worker installs the import hook, then runs the script
        script_args = [*(["-m"] if module else []), script, *script_args]
        module, script = True, "ember.lightning_compat"
    try:
        if args.replica_groups is not None:
            from ember import replica_groups

            return replica_groups.run(
                replica_groups=args.replica_groups, replica_group=args.replica_group, lighthouse=args.lighthouse,
                nproc_per_node=launch.processes_per_node(args.nproc_per_node), max_restarts=args.max_restarts,
                module=module, script=script, script_args=script_args,
            )  # fmt: skip
        return launch.run(
            nproc_per_node=args.nproc_per_node,
            nnodes=args.nnodes,
            node_rank=args.node_rank,
            rdzv_endpoint=args.rdzv_endpoint,
            rdzv_id=args.rdzv_id,
            max_restarts=args.max_restarts,
            module=module,
            script=script,
            script_args=script_args,
        )
    except ValueError as error:
        print(f"ember run: {error}", file=sys.stderr)
        return 2


def _doctor(args: argparse.Namespace) -> int:
    from ember import doctor, launch

    if args.steps <= 5:
        print(f"ember doctor: --steps={args.steps}: give more than the 5 warm-up steps", file=sys.stderr)
        return 2
    processes = launch.processes_per_node(args.nproc_per_node)
    if processes > 1:  # each worker runs the doctor itself, on the script
        flags = ["--steps", str(args.steps), *(["--json"] if args.json else []), *(["-m"] if args.module else [])]
        flags += ["--lightning"] if args.lightning else []
        return launch.run(
            nproc_per_node=str(processes), nnodes=1, node_rank=None, rdzv_endpoint=None, rdzv_id="ember",
            max_restarts=0, module=True, script="ember", script_args=["doctor", *flags, args.script, *args.script_args],
        )  # fmt: skip
    if args.lightning:
        from ember import lightning_compat

        lightning_compat.install()
    return doctor.run_script(args.script, args.script_args, steps=args.steps, as_json=args.json, module=args.module)


def _plot(args: argparse.Namespace) -> int:
    from ember.plot import plot

    metrics = [name.strip() for name in args.metrics.split(",") if name.strip()] if args.metrics else None
    try:
        written = plot(args.runs, args.output, metrics, args.x)
    except (ImportError, OSError, ValueError) as error:  # no matplotlib, no such file, nothing to plot
        print(f"ember plot: {error}", file=sys.stderr)
        return 2
    print(f"wrote {written}")
    return 0


def _consolidate(args: argparse.Namespace) -> int:
    from ember import checkpoint

    if not checkpoint.sharded.is_sharded(args.directory):
        print(f"ember checkpoint consolidate: DIR {args.directory!r} is not a sharded checkpoint", file=sys.stderr)
        return 2
    try:
        state = checkpoint.load(args.directory, trust_pickles=args.trust_pickles)
    except checkpoint.CheckpointError as error:
        print(f"ember checkpoint consolidate: {error} (--trust-pickles does that here)", file=sys.stderr)
        return 1
    checkpoint.save(state, args.output)
    print(f"wrote {args.output}")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args, unknown = parser.parse_known_args(argv)
    if args.command is None and not unknown:
        parser.print_help()
        return 0
    command = " ".join(["ember", *(getattr(args, name) for name in ("command", "action") if getattr(args, name, None))])
    # Unknown flags are reported by the command they were given to; the arguments are checked before
    # anything starts: a missing script is one line, not a worker's traceback and the launcher's report.
    problem = f"unrecognized arguments: {' '.join(unknown)} (see {command} --help)" if unknown else None
    problem = problem or _argument_problem(args)
    if problem is not None:
        print(f"{command}: {problem}", file=sys.stderr)
        return 2
    return args.handler(args)


def _argument_problem(args: argparse.Namespace) -> str | None:
    """What is wrong with the arguments of the command, in words (None: nothing found)."""
    if args.command in ("run", "doctor"):
        from ember import launch

        try:
            launch.processes_per_node(args.nproc_per_node)
            if args.command == "run":
                launch.check_run_arguments(args.nnodes, args.node_rank, args.rdzv_endpoint, args.max_restarts)
                _check_replica_arguments(args)
        except ValueError as error:
            return str(error)
        return _script_problem(args.script, args.module)
    if args.command == "plot":
        return _output_problem(args.output, "--output")
    if args.command == "checkpoint":
        if not os.path.exists(args.directory):
            return f"DIR {args.directory!r}: no such directory"
        return _output_problem(args.output, "OUT")
    return None


def _check_replica_arguments(args: argparse.Namespace) -> None:
    """``--replica-groups`` and the flags that go with it (ValueError naming the one that cannot work)."""
    if args.replica_groups is not None:
        from ember import replica_groups

        replica_groups.check_arguments(args.replica_groups, args.replica_group, args.lighthouse, args.nnodes)
    elif args.replica_group is not None or args.lighthouse is not None:
        raise ValueError(f"--{'replica-group' if args.replica_group is not None else 'lighthouse'} goes with "
                         "--replica-groups G (fault tolerance)")  # fmt: skip


def _script_problem(script: str, module: bool) -> str | None:
    if not module:
        if os.path.isfile(script) or os.path.isfile(os.path.join(script, "__main__.py")):
            return None
        return f"SCRIPT {script!r}: no such file (give a Python script, or -m and a module name)"
    if not all(part.isidentifier() for part in script.split(".")):
        return f"-m {script!r}: not a module name (such as mypackage.train)"
    # The workers run `python -m SCRIPT` from this directory; only the top package is looked up, so that
    # nothing of it is imported here.
    top = script.partition(".")[0]
    if importlib.util.find_spec(top) or importlib.machinery.PathFinder.find_spec(top, [os.getcwd()]):
        return None
    return f"-m {script!r}: no module {top!r} here or among the installed packages"


def _output_problem(path: str, flag: str) -> str | None:
    if os.path.isdir(path):
        return f"{flag} {path!r} is a directory: give the name of the file to write"
    parent = os.path.dirname(os.path.abspath(path))
    while not os.path.exists(parent):
        parent = os.path.dirname(parent)
    if not os.path.isdir(parent) or not os.access(parent, os.W_OK):
        return f"{flag} {path!r} cannot be written: {parent!r} is not a directory you can write to"
    return None


if __name__ == "__main__":
    sys.exit(main())
