"""What the two-process programs leave for the suite to compare: the trainer's state, from global rank zero."""

import json
import os


def write_summary(trainer, root_dir, **values):
    if trainer.global_rank != 0:
        return
    summary = {f"trainer.{name}": float(value) for name, value in trainer.callback_metrics.items()}
    summary.update({"trainer.global_step": trainer.global_step, "trainer.current_epoch": trainer.current_epoch})
    summary.update({name: float(value) for name, value in values.items()})
    with open(os.path.join(root_dir, "summary.json"), "w") as file:
        json.dump(summary, file)
