"""Writing predictions to disk while predicting, in the shape of Lightning's documented
`CustomWriter(BasePredictionWriter)`: one file per batch (with the sample indices it covers) and one file
with every prediction at the end, from `trainer.predict(..., return_predictions=False)`.

Data: scikit-learn's digits; a classifier trained for one epoch, then inference over the test split. Nothing
is shuffled, so every value is compared.
"""

import os
import sys

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from lightning.pytorch.callbacks import BasePredictionWriter
from sklearn.datasets import load_digits
from torch import nn
from torch.utils.data import DataLoader, TensorDataset


class CustomWriter(BasePredictionWriter):
    def __init__(self, output_dir, write_interval):
        super().__init__(write_interval)
        self.output_dir = output_dir

    def write_on_batch_end(self, trainer, pl_module, prediction, batch_indices, batch, batch_idx, dataloader_idx):
        torch.save({"prediction": prediction, "indices": list(batch_indices)},
                   os.path.join(self.output_dir, f"batch_{dataloader_idx}_{batch_idx}.pt"))  # fmt: skip

    def write_on_epoch_end(self, trainer, pl_module, predictions, batch_indices):
        torch.save({"predictions": predictions, "indices": batch_indices},
                   os.path.join(self.output_dir, f"predictions_{trainer.global_rank}.pt"))  # fmt: skip


class DigitClassifier(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 10))

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.cross_entropy(self.net(x), y)
        self.log("train_loss", loss)
        return loss

    def predict_step(self, batch, batch_idx, dataloader_idx=0):
        x, _ = batch
        return self.net(x).softmax(dim=-1)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def main(root_dir="."):
    pl.seed_everything(2)
    images, labels = load_digits(return_X_y=True)
    data = TensorDataset(torch.tensor(images / 16.0, dtype=torch.float32), torch.tensor(labels))
    train, test = torch.utils.data.Subset(data, range(1500)), torch.utils.data.Subset(data, range(1500, 1797))
    output_dir = os.path.join(root_dir, "predictions")
    os.makedirs(output_dir, exist_ok=True)
    writer = CustomWriter(output_dir, write_interval="batch_and_epoch")
    trainer = pl.Trainer(max_epochs=1, callbacks=[writer], default_root_dir=root_dir, enable_progress_bar=False)
    model = DigitClassifier()
    trainer.fit(model, DataLoader(train, batch_size=50))
    nothing = trainer.predict(model, DataLoader(test, batch_size=100), return_predictions=False)
    written = torch.load(os.path.join(output_dir, "predictions_0.pt"), weights_only=True)
    first = torch.load(os.path.join(output_dir, "batch_0_1.pt"), weights_only=True)
    assert nothing is None and first["indices"] == list(range(100, 200))
    return {"trainer": trainer, "predictions": torch.cat(written["predictions"]), "indices": written["indices"]}


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else ".")
