"""Lightning's public behaviour of a training step's optimization: what ``training_step`` may return under manual
and automatic optimization, the closure an optimizer runs, and a skipped step with several processes."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from conftest import Regressor, make_loader, parameters_of, quiet_trainer

from ember.exceptions import MisconfigurationException
from ember.loops import StepRunner
from ember.strategies import SingleDeviceStrategy


class _Manual(Regressor):
    """Steps its optimizer itself, then returns ``returned`` from ``training_step``."""

    def __init__(self, returned: Any) -> None:
        super().__init__()
        self.automatic_optimization = False
        self.returned = returned

    def training_step(self, batch: Any, batch_idx: int) -> Any:
        optimizer = self.optimizers()
        loss = super().training_step(batch, batch_idx)
        self.manual_backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        return self.returned(loss) if callable(self.returned) else self.returned


@pytest.mark.parametrize("returned", [5, "loss", 0.5])
def test_a_manual_training_step_that_returns_neither_a_tensor_nor_a_dict_is_refused(returned: Any) -> None:
    with pytest.raises(MisconfigurationException, match="must either return a Tensor or have no return") as error:
        quiet_trainer(max_steps=1, logger=False).fit(_Manual(returned), make_loader())
    assert type(returned).__name__ in str(error.value)


@pytest.mark.parametrize(
    "returned", [None, lambda loss: loss, lambda loss: {"loss": loss, "other": 1}, lambda loss: {"other": 1}]
)
def test_a_manual_training_step_may_return_a_tensor_a_dict_or_nothing(returned: Callable[..., Any] | None) -> None:
    trainer = quiet_trainer(max_steps=2, logger=False, enable_checkpointing=False)
    trainer.fit(_Manual(returned), make_loader())
    assert trainer.global_step == 2


class _NoGradClosureSGD(torch.optim.SGD):
    """An optimizer whose ``step`` runs under ``torch.no_grad()`` and requires its closure (no default), as some
    third-party optimizers do."""

    @torch.no_grad()
    def step(self, closure: Callable[[], Any]) -> Any:  # type: ignore[override]
        loss = closure()
        super().step()
        return loss


def test_the_closure_an_optimizer_runs_under_no_grad_still_builds_a_graph() -> None:
    grad_enabled: list[bool] = []

    class Module(Regressor):
        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            grad_enabled.append(torch.is_grad_enabled())
            return super().training_step(batch, batch_idx)

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return _NoGradClosureSGD(self.parameters(), lr=0.1)

    module = Module()
    before = parameters_of(module)
    quiet_trainer(max_steps=2, logger=False, enable_checkpointing=False).fit(module, make_loader())
    assert grad_enabled == [True, True]
    assert not torch.equal(before[0], module.layer.weight)


class _OneOfTwoRanks(SingleDeviceStrategy):
    """A strategy that says it is rank 1 of 2, without another process."""

    @property
    def world_size(self) -> int:
        return 2

    @property
    def global_rank(self) -> int:
        return 1


def test_a_skipped_training_step_is_refused_with_several_processes() -> None:
    class Skips(Regressor):
        def training_step(self, batch: Any, batch_idx: int) -> None:
            return None

    module = Skips()
    strategy = _OneOfTwoRanks()
    strategy.setup_module(module, training=True)
    runner = StepRunner(strategy, module, [torch.optim.SGD(module.parameters(), lr=0.1)])
    with pytest.raises(RuntimeError, match=r"Skipping the `training_step` by returning None in distributed training "
                       r"is not supported: Skips.training_step returned None on rank 1 of 2"):  # fmt: skip
        runner.step(next(iter(make_loader(8, batch_size=4))), 0)
