"""A callback and a module that count every hook Lightning calls, as debugging and profiling callbacks in
many projects do: fit (with sanity check, gradient accumulation and validation), validate, test and predict.
The counts, and the order of the first calls, are compared hook by hook.

Data: generated tensors. Nothing is shuffled.
"""

import sys
from collections import Counter

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from lightning.pytorch.callbacks import Callback
from torch.utils.data import DataLoader, TensorDataset

CALLBACK_HOOKS = [
    "setup", "teardown", "on_fit_start", "on_fit_end", "on_sanity_check_start", "on_sanity_check_end",
    "on_train_start", "on_train_end", "on_train_epoch_start", "on_train_epoch_end", "on_train_batch_start",
    "on_train_batch_end", "on_validation_start", "on_validation_end", "on_validation_epoch_start",
    "on_validation_epoch_end", "on_validation_batch_start", "on_validation_batch_end", "on_test_start",
    "on_test_end", "on_test_epoch_start", "on_test_epoch_end", "on_test_batch_start", "on_test_batch_end",
    "on_predict_start", "on_predict_end", "on_predict_epoch_start", "on_predict_epoch_end",
    "on_predict_batch_start", "on_predict_batch_end", "on_before_backward", "on_after_backward",
    "on_before_optimizer_step", "on_before_zero_grad", "on_save_checkpoint",
]  # fmt: skip
MODULE_HOOKS = [name for name in CALLBACK_HOOKS if name not in ("on_sanity_check_start", "on_sanity_check_end")]
MODULE_HOOKS += ["prepare_data", "configure_model", "on_validation_model_eval", "on_test_model_eval",
                 "on_predict_model_eval"]  # fmt: skip


class HookCounter(Callback):
    def __init__(self):
        self.counts = Counter()
        self.first_calls = []


def _count(owner_name, hook_name):
    def hook(self, *args, **kwargs):
        self.counts[hook_name] += 1
        if hook_name not in self.first_calls:
            self.first_calls.append(hook_name)
        original = getattr(pl.LightningModule if owner_name == "module" else Callback, hook_name, None)
        if owner_name == "module" and hook_name.endswith("_model_eval"):
            return original(self, *args, **kwargs)  # the default puts the module in evaluation mode
        return None

    return hook


for _name in CALLBACK_HOOKS:
    setattr(HookCounter, _name, _count("callback", _name))


class CountingModel(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.layer = torch.nn.Linear(3, 1)
        self.counts = Counter()
        self.first_calls = []

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.mse_loss(self.layer(x), y)
        self.log("loss", loss)
        return loss

    def validation_step(self, batch, batch_idx):
        self.log("val_loss", F.mse_loss(self.layer(batch[0]), batch[1]))

    def test_step(self, batch, batch_idx):
        self.log("test_loss", F.mse_loss(self.layer(batch[0]), batch[1]))

    def predict_step(self, batch, batch_idx):
        return self.layer(batch[0])

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)


for _name in MODULE_HOOKS:
    setattr(CountingModel, _name, _count("module", _name))


def main(root_dir="."):
    pl.seed_everything(0)
    x = torch.randn(40, 3)
    data = TensorDataset(x, x.sum(dim=1, keepdim=True))
    loader = DataLoader(data, batch_size=8)
    counter, model = HookCounter(), CountingModel()
    trainer = pl.Trainer(
        max_epochs=2, accumulate_grad_batches=2, limit_val_batches=3, callbacks=[counter],
        default_root_dir=root_dir, enable_progress_bar=False, enable_model_summary=False,
    )  # fmt: skip
    trainer.fit(model, loader, loader)
    trainer.validate(model, loader)
    trainer.test(model, loader)
    trainer.predict(model, loader)
    return {
        "trainer": trainer,
        "callback": dict(counter.counts),
        "module": dict(model.counts),
        "callback_order": "/".join(counter.first_calls),
        "module_order": "/".join(model.first_calls),
    }


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else ".")
