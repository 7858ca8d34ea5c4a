"""The ``ember`` command (also ``python -m ember``)."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

import ember

_RUN_EPILOG = """\
examples:
  ember run --nproc-per-node 2 train.py --lr 0.1          two processes on this machine
  ember run --nproc-per-node auto train.py                one per GPU (one on a machine without GPUs)
  ember run --nnodes 2 --node-rank 0 --rdzv-endpoint 10.0.0.1:29400 train.py   on node 0 of two
  ember run --nnodes 2 --node-rank 1 --rdzv-endpoint 10.0.0.1:29400 train.py   on node 1
  ember run --nproc-per-node 4 -m mypackage.train         run a module, as python -m does

Each worker sees RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT; the script's Trainer
picks them up (devices="auto" becomes the number of processes per node). If any worker fails, the
others are stopped within seconds and the exit status is non-zero.
"""

_CONSOLIDATE_DESCRIPTION = """\
Read the sharded checkpoint DIR (a directory written by strategy="fsdp", "model_parallel" or
"pipeline", each rank its own shard) in one process and write it as the single file OUT: full
tensors, and optimizer states as Optimizer.state_dict() has them. OUT is an ordinary checkpoint:
Trainer.fit(ckpt_path=OUT) resumes from it with any strategy and number of devices, and
Module.load_from_checkpoint(OUT) loads the weights. Needs memory for the whole model.
"""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
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
        "-m", "--module", action="store_true", help="SCRIPT is a module name, run as python -m SCRIPT"
    )  # fmt: skip
    run.add_argument("script", metavar="SCRIPT", help="the training script (or module, with -m)")
    run.add_argument("script_args", nargs=argparse.REMAINDER, metavar="ARGS", help="arguments for the script")
    run.set_defaults(handler=_run)

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


def _run(args: argparse.Namespace) -> int:
    from ember import launch

    try:
        return launch.run(
            nproc_per_node=args.nproc_per_node,
            nnodes=args.nnodes,
            node_rank=args.node_rank,
            rdzv_endpoint=args.rdzv_endpoint,
            rdzv_id=args.rdzv_id,
            max_restarts=args.max_restarts,
            module=args.module,
            script=args.script,
            script_args=args.script_args,
        )
    except ValueError as error:
        print(f"ember run: {error}", file=sys.stderr)
        return 2


def _consolidate(args: argparse.Namespace) -> int:
    from ember import checkpoint, sharded_checkpoint

    if not sharded_checkpoint.is_sharded(args.directory):
        print(f"ember checkpoint consolidate: {args.directory!r} is not a sharded checkpoint", file=sys.stderr)
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
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 0
    return args.handler(args)


if __name__ == "__main__":
    sys.exit(main())
