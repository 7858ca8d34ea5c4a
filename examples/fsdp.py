"""Fully sharded data parallel (FSDP): the character-level GPT of ``char_gpt.py``, sharded over two processes.

    python examples/fsdp.py                                 # the Trainer starts both processes (Gloo on CPU)
    ember run --nproc-per-node 2 examples/fsdp.py           # or a launcher does
    python examples/fsdp.py --accelerator cuda --devices 2 --precision bf16-mixed   # on two GPUs

Each process keeps half of every parameter, gradient and optimizer state; each transformer block is
gathered whole just for its own forward and backward (``auto_wrap_policy={Block}``). Moving the model
from one process to FSDP is the ``strategy=`` flag: the module is the same as in ``char_gpt.py``.
The last checkpoint is a directory with one shard per process; at the end, rank zero loads it whole
into an ordinary module with ``load_from_checkpoint`` and measures its validation loss.
The script exits with status 1 unless each process held about half of the parameters and the
validation loss (nats per character) is below --target, well under the unigram entropy.
"""

from __future__ import annotations

import argparse
import sys

import torch
from char_gpt import Block, CharGPT, Windows, stdlib_text, unigram_entropy
from torch.utils.data import DataLoader

import ember
from ember.callbacks import ModelCheckpoint
from ember.strategies import FSDPStrategy


class ShardedCharGPT(CharGPT):
    """``CharGPT`` that also reports how much of the model this process holds once training starts."""

    def on_train_start(self) -> None:
        total = sum(parameter.numel() for parameter in self.parameters())
        # Under FSDP each parameter is a DTensor; to_local() is this process's shard of it.
        held = sum(getattr(p, "to_local", lambda p=p: p)().numel() for p in self.parameters())
        self.held_fraction = held / total
        print(f"rank {self.global_rank}: holds {held} of {total} parameter values ({held / total:.0%})", flush=True)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--max-steps", type=int, default=200)
    parser.add_argument("--width", type=int, default=64)
    parser.add_argument("--context", type=int, default=32, help="characters the model sees")
    parser.add_argument("--batch-size", type=int, default=16, help="per process")
    parser.add_argument("--accelerator", default="cpu", help="cpu (Gloo) or cuda (NCCL)")
    parser.add_argument("--devices", default="2", help="processes on this machine")
    parser.add_argument("--precision", default="32-true", help="32-true, or bf16-mixed on GPUs")
    parser.add_argument("--root-dir", default="runs/fsdp", help="where logs and checkpoints go")
    parser.add_argument("--target", type=float, default=2.4, help="fail if the validation loss (nats/char) is above")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    ember.seed_everything(0)
    text = stdlib_text()
    alphabet = sorted(set(text))
    index = {char: i for i, char in enumerate(alphabet)}
    tokens = torch.tensor([index[char] for char in text], dtype=torch.long)
    split = int(0.9 * len(tokens))
    entropy = unigram_entropy(tokens[:split], len(alphabet))
    context = args.context
    # Each process reads its own half of every epoch: the Trainer gives the loaders a DistributedSampler.
    train_loader = DataLoader(Windows(tokens[:split], context, stride=1), batch_size=args.batch_size, shuffle=True)
    val_loader = DataLoader(Windows(tokens[split:], context, stride=context), batch_size=64)

    checkpoint = ModelCheckpoint(save_last=True, every_n_train_steps=args.max_steps)
    trainer = ember.Trainer(
        accelerator=args.accelerator,
        devices=args.devices,
        strategy=FSDPStrategy(auto_wrap_policy={Block}),
        precision=args.precision,
        max_steps=args.max_steps,
        val_check_interval=args.max_steps // 2,
        gradient_clip_val=1.0,  # the norm is computed over the whole model, every shard
        callbacks=[checkpoint],
        default_root_dir=args.root_dir,
        enable_model_summary=False,
        log_every_n_steps=25,
    )
    model = ShardedCharGPT(len(alphabet), context=context, width=args.width, lr=1e-2)
    trainer.fit(model, train_loader, val_loader, ckpt_path="last")  # continues when run again
    val_loss = float(trainer.callback_metrics["val_loss"])  # averaged over both processes' batches
    trainer.print(f"val_loss {val_loss:.3f} nats/char (unigram entropy {entropy:.3f}); target < {args.target}")

    failures = []
    if abs(model.held_fraction - 1 / trainer.world_size) > 0.05:
        failures.append(f"rank {trainer.global_rank} held {model.held_fraction:.0%} of the model")
    if val_loss >= args.target:
        failures.append(f"val_loss {val_loss:.3f} is not below the target {args.target}")
    if trainer.is_global_zero:
        # The sharded checkpoint, read whole in this one process: an ordinary module, no process group needed.
        whole = CharGPT.load_from_checkpoint(checkpoint.last_model_path)
        assert isinstance(whole, CharGPT)
        whole.eval()
        with torch.no_grad():
            losses = [(whole.loss(batch), len(batch[0])) for batch in val_loader]
        reloaded = float(sum(loss * size for loss, size in losses) / sum(size for _, size in losses))
        print(f"{checkpoint.last_model_path} (a directory of shards), loaded whole: val_loss {reloaded:.3f}")
        if abs(reloaded - val_loss) > 0.02:
            failures.append(f"the reloaded checkpoint's val_loss {reloaded:.3f} differs from {val_loss:.3f}")
    for failure in failures:
        print(f"FAILED on rank {trainer.global_rank}: {failure}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
