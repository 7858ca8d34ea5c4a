"""ModelPruning: how much it prunes and when, the lottery ticket reset, plain weights in checkpoints and at the
end, what it logs, and the settings it refuses."""

from __future__ import annotations

import copy
import logging
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from conftest import make_loader, quiet_trainer
from torch import nn

import ember
from ember.callbacks import ModelCheckpoint, ModelPruning
from ember.exceptions import MisconfigurationException


class _Net(ember.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Linear(16, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return F.mse_loss(self(x), y)

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        self.log("val_loss", F.mse_loss(self(x), y))

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.01)


def _fit(callback: ModelPruning, epochs: int = 1, model: _Net | None = None, **flags: Any) -> _Net:
    model = model or _Net()
    trainer = quiet_trainer(max_epochs=epochs, logger=False, callbacks=[callback], **flags)
    trainer.fit(model, make_loader(32), make_loader(16))
    return model


def _zeros(model: nn.Module) -> dict[str, int]:
    return {name: int((tensor == 0).sum()) for name, tensor in model.state_dict().items()}


def test_the_defaults_prune_half_of_every_layer_s_weights_and_biases_together_and_leave_plain_weights() -> None:
    initial = copy.deepcopy(_Net().state_dict())
    model = _fit(ModelPruning("l1_unstructured", parameters_to_prune=None))
    state = model.state_dict()
    # The masks are folded in when training ends: plain parameters, no pruning hooks left.
    assert sorted(state) == sorted(initial)
    assert not any(layer._forward_pre_hooks for layer in model.modules())
    total = sum(tensor.numel() for tensor in state.values())
    assert sum(_zeros(model).values()) == round(total * 0.5)
    # The lottery ticket: what is kept has its values from before training.
    for name, tensor in state.items():
        kept = tensor != 0
        assert torch.equal(tensor[kept], initial[name][kept])


def test_local_structured_pruning_takes_a_count_each_epoch_where_apply_pruning_says(tmp_path: Any) -> None:
    model = _Net()
    first = model.net[0]
    callback = ModelPruning(
        "ln_structured",
        parameters_to_prune=[(first, "weight")],
        use_global_unstructured=False,
        amount=lambda epoch: 1 + epoch,
        apply_pruning=lambda epoch: epoch != 1,
        pruning_dim=0,
        pruning_norm=2,
        use_lottery_ticket_hypothesis=False,
        make_pruning_permanent=False,
    )
    _fit(callback, epochs=3, model=model, default_root_dir=tmp_path)
    # Epoch 0 prunes 1 row of the weight, epoch 1 none, epoch 2 three of the rows left: 4 rows of 16 in all.
    assert int((first.weight_mask.sum(dim=1) == 0).sum()) == 4
    assert "bias_mask" not in dict(first.named_buffers())
    assert not hasattr(model.net[2], "weight_mask")


def test_checkpoints_saved_while_pruning_hold_plain_weights_and_training_keeps_its_masks(tmp_path: Any) -> None:
    callback = ModelPruning("l1_unstructured", amount=0.3, make_pruning_permanent=True)
    checkpoint = ModelCheckpoint(dirpath=tmp_path, save_last=True)
    model = _Net()
    trainer = quiet_trainer(max_epochs=2, logger=False, callbacks=[callback, checkpoint])
    trainer.fit(model, make_loader(32), make_loader(16))
    saved = torch.load(tmp_path / "last.ckpt", weights_only=False)["state_dict"]
    assert sorted(saved) == sorted(_Net().state_dict())
    assert sum(int((tensor == 0).sum()) for tensor in saved.values()) == sum(_zeros(model).values())


def test_pruning_after_fit_s_validations_trains_on_with_the_masks() -> None:
    # A validation of fit runs under no_grad (not inference_mode): the masks it makes are trained with afterwards.
    callback = ModelPruning("random_unstructured", amount=0.25, prune_on_train_epoch_end=False)
    model = _fit(callback, epochs=2, num_sanity_val_steps=2)
    total = sum(tensor.numel() for tensor in model.state_dict().values())
    # Two validations (the sanity check prunes nothing): a quarter, then a quarter of what is left.
    assert sum(_zeros(model).values()) == round(total * 0.25) + round((total - round(total * 0.25)) * 0.25)


def test_verbose_logs_the_sparsity_overall_and_of_each_parameter(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="ember"):
        _fit(ModelPruning("l1_unstructured", amount=0.5, parameter_names=["weight"], verbose=2))
    messages = [record.getMessage() for record in caplog.records if "Applied" in record.getMessage()]
    assert messages[0] == "Applied `L1Unstructured`. Pruned: 0/80 (0.00%) -> 40/80 (50.00%)"
    assert len(messages) == 3 and messages[1].startswith(
        "Applied `L1Unstructured` to `Linear(in_features=4, out_features=16, bias=True).weight` with amount=0.5."
    )


def test_a_pruning_method_class_prunes_globally() -> None:
    model = _fit(ModelPruning(torch.nn.utils.prune.RandomUnstructured, amount=10))
    assert sum(_zeros(model).values()) == 10


@pytest.mark.parametrize(
    ("arguments", "message"),
    [
        (dict(pruning_fn="l2_unstructured"), "`pruning_fn` l2_unstructured isn't available"),
        (dict(pruning_fn="ln_structured", use_global_unstructured=False), "the `pruning_dim` should be provided"),
        (dict(pruning_fn="ln_structured", use_global_unstructured=False, pruning_dim=0),
         "the `pruning_norm` should be provided"),
        (dict(pruning_fn="random_structured", pruning_dim=0), 'Only the "unstructured" PRUNING_TYPE is supported'),
        (dict(pruning_fn=torch.nn.utils.prune.L1Unstructured, use_global_unstructured=False),
         "only supported with `use_global_unstructured=True`"),
        (dict(pruning_fn=torch.nn.utils.prune.L1Unstructured(0.5)), "pass the class, not an instance"),
        (dict(pruning_fn="l1_unstructured", amount="half"), "`amount` should be provided"),
        (dict(pruning_fn="l1_unstructured", verbose=3), r"`verbose` must be any of \(0, 1, 2\)"),
        (dict(pruning_fn="l1_unstructured", parameter_names=["gamma"]), "name: gamma isn't in"),
    ],
)  # fmt: skip
def test_settings_it_cannot_use_are_refused_naming_them(arguments: dict[str, Any], message: str) -> None:
    with pytest.raises(MisconfigurationException, match=message):
        ModelPruning(**arguments)


@pytest.mark.parametrize(
    ("pairs", "message"),
    [
        ([(nn.Linear(2, 2), "weight")], "don't exist in the model. Found missing modules"),
        ([(0, "weight")], "should either be list of tuple with 2 elements"),
    ],
)
def test_parameters_to_prune_not_in_the_model_are_refused_when_fit_starts(pairs: Any, message: str) -> None:
    with pytest.raises(MisconfigurationException, match=message):
        _fit(ModelPruning("l1_unstructured", parameters_to_prune=pairs))
