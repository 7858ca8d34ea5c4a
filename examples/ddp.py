"""Data parallel training (DDP) on the digits: two processes, each reading its own half of every epoch.

    python examples/ddp.py                                  # the Trainer starts both processes (Gloo on CPU)
    ember run --nproc-per-node 2 examples/ddp.py            # or a launcher does (torchrun works too)
    python examples/ddp.py --accelerator cuda --devices 4   # one process per GPU (NCCL)

The model and data are those of ``digits.py``. Nothing in them knows about processes: the Trainer gives
each loader a ``DistributedSampler``, wraps the module in ``DistributedDataParallel`` (gradients are
averaged in the backward), and reduces the metrics logged with ``sync_dist=True`` across processes.
Each process prints how many batches it reads; at the end the processes compare their parameters,
which must be identical. The script exits with status 1 if they differ or if the best validation
accuracy is below --target.
"""

from __future__ import annotations

import argparse
import sys

import torch
import torch.distributed as dist
from digits import DigitsCNN, DigitsData

import ember
from ember.callbacks import ModelCheckpoint


class ReplicatedCNN(DigitsCNN):
    """``DigitsCNN``, plus a look at what each process does."""

    def on_train_start(self) -> None:
        batches = self.trainer.num_training_batches
        print(f"rank {self.global_rank} of {self.trainer.world_size}: {batches} batches per epoch", flush=True)

    def on_train_end(self) -> None:
        # Every process gathers every process's parameters: DDP keeps the replicas identical.
        self.replicas_identical = True
        if not dist.is_initialized():
            return  # a single process
        mine = torch.cat([parameter.detach().flatten() for parameter in self.parameters()])
        everyone = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
        dist.all_gather(everyone, mine)
        self.replicas_identical = all(torch.equal(mine, other) for other in everyone)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--max-epochs", type=int, default=12)
    parser.add_argument("--batch-size", type=int, default=32, help="per process: two processes make batches of 64")
    parser.add_argument("--accelerator", default="cpu", help="cpu (Gloo) or cuda (NCCL)")
    parser.add_argument("--devices", default="2", help="processes on this machine, one per device")
    parser.add_argument("--root-dir", default="runs/ddp", help="where logs and checkpoints go")
    parser.add_argument("--target", type=float, default=0.95, help="fail if the best val_acc is below this")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    ember.seed_everything(0)  # the same initial weights in every process (DDP also broadcasts rank 0's)
    checkpoint = ModelCheckpoint(monitor="val_acc", mode="max")
    trainer = ember.Trainer(
        accelerator=args.accelerator,
        devices=args.devices,
        strategy="ddp",
        max_epochs=args.max_epochs,
        default_root_dir=args.root_dir,
        callbacks=[checkpoint],
        enable_model_summary=False,
        log_every_n_steps=10,
    )
    model = ReplicatedCNN()
    trainer.fit(model, datamodule=DigitsData(batch_size=args.batch_size), ckpt_path="last")  # continues when run again
    # val_acc was logged with sync_dist=True, so every process holds the same value and takes the same decisions.
    best = float(checkpoint.best_model_score or 0.0)  # None: never validated
    trainer.print(f"best val_acc {best:.4f} over {trainer.world_size} processes (target {args.target})")
    if not model.replicas_identical:
        print(f"FAILED: rank {trainer.global_rank}'s parameters differ from another rank's")
        return 1
    if best < args.target:
        trainer.print(f"FAILED: val_acc {best:.4f} is below the target {args.target}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
