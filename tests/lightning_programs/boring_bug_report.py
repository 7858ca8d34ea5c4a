"""The shape of a Lightning bug report: `BoringModel` and `RandomDataset` from
`lightning.pytorch.demos.boring_classes`, a quick `fast_dev_run`, then the same model on `overfit_batches`
with `limit_val_batches`, and `trainer.predict` on the model's own predict loader.

Data: the demo's random vectors (drawn from the seeded generator). Nothing is shuffled.
"""

import sys

import lightning.pytorch as pl
import torch
from lightning.pytorch.demos.boring_classes import BoringModel, RandomDataset
from torch.utils.data import DataLoader


class ReportModel(BoringModel):
    def training_step(self, batch, batch_idx):
        output = super().training_step(batch, batch_idx)
        self.log("loss", output["loss"])
        return output

    def validation_step(self, batch, batch_idx):
        loss = self.step(batch)
        self.log("valid_loss", loss)


def main(root_dir="."):
    pl.seed_everything(0)
    model = ReportModel()
    quick = pl.Trainer(fast_dev_run=True, default_root_dir=root_dir)
    quick.fit(model)
    overfit = pl.Trainer(
        max_epochs=3, overfit_batches=4, limit_val_batches=2, default_root_dir=root_dir, enable_progress_bar=False
    )
    overfit.fit(model, DataLoader(RandomDataset(32, 64), batch_size=8), DataLoader(RandomDataset(32, 64), batch_size=8))
    predictions = overfit.predict(model)
    return {"quick": quick, "overfit": overfit, "predictions": torch.cat(predictions)}


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else ".")
