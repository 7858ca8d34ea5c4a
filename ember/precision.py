"""Numerical precision: one small class per ``precision=`` mode.

Each class owns the autocast context of the forward pass, how the loss is backpropagated, how the
optimizer steps, and its own state (the fp16 ``GradScaler``'s scale goes into checkpoints).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn

from ember._utils import apply_to_tensors
from ember.lightning_compat.hook import is_installed as lightning_names_served
from ember.rank_zero import rank_zero_warn, rank_zero_warn_once

# Every spelling users pass, mapped to the canonical name.
_ALIASES: dict[str | int, str] = {
    "32-true": "32-true", "32": "32-true", 32: "32-true",
    "64-true": "64-true", "64": "64-true", 64: "64-true",
    "16-mixed": "16-mixed", "16": "16-mixed", 16: "16-mixed",
    "bf16-mixed": "bf16-mixed", "bf16": "bf16-mixed",
    "16-true": "16-true", "bf16-true": "bf16-true",
}  # fmt: skip
_HISTORICAL = (16, "16", "bf16")  # the spellings Lightning still takes but advises against


def canonical_precision(flag: str | int) -> str:
    """The canonical name of a ``precision=`` value, or a ``ValueError`` that lists the accepted ones."""
    name = _ALIASES.get(flag) if isinstance(flag, (str, int)) else None
    if name is None:
        accepted = ", ".join(repr(key) for key in _ALIASES)
        raise ValueError(f"precision={flag!r}: Precision {flag!r} is invalid. Allowed precision values: {accepted}")
    return name


# Reusable: entering it allocates nothing, which matters once per step.
_NO_CONTEXT = contextlib.nullcontext()


class Precision:
    """Full float32 precision ("32-true"): the forward runs as written, gradients are not scaled."""

    name = "32-true"
    #: Whether ``convert_input`` changes batches (the loop skips the call otherwise).
    converts_input = False
    #: Whether ``forward_context`` does anything (the training step skips entering it otherwise).
    wraps_forward = False
    #: Whether gradients are scaled (then backward, unscaling and stepping go through this plugin).
    scales_gradients = False

    def convert_module(self, module: nn.Module) -> nn.Module:
        return module

    def convert_input(self, data: Any) -> Any:
        return data

    def forward_context(self) -> contextlib.AbstractContextManager:
        return _NO_CONTEXT

    def backward(self, loss: torch.Tensor, backward: Callable[[torch.Tensor], None] | None = None) -> None:
        """Backpropagate ``loss``, through ``backward`` (the module's own) when given."""
        (backward or torch.Tensor.backward)(loss)

    def unscale_gradients(self, optimizer: torch.optim.Optimizer) -> None:
        """Bring gradients to their true scale before they are clipped or inspected."""

    def optimizer_step(
        self, optimizer: torch.optim.Optimizer, closure: Callable[[], Any] | None = None, **kwargs: Any
    ) -> Any:
        """Step ``optimizer``; a ``closure`` (and ``kwargs``) go to its ``step``, which runs it and returns what it
        returns."""
        return optimizer.step(closure=closure, **kwargs) if closure is not None else optimizer.step(**kwargs)

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        pass


class TruePrecision(Precision):
    """Parameters, inputs and new tensors in one dtype: "64-true", "16-true" or "bf16-true"."""

    converts_input = True
    wraps_forward = True

    def __init__(self, name: str, dtype: torch.dtype) -> None:
        self.name = name
        self.dtype = dtype

    def convert_module(self, module: nn.Module) -> nn.Module:
        return module.to(dtype=self.dtype)

    def convert_input(self, data: Any) -> Any:
        return apply_to_tensors(data, self._cast)

    def _cast(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor.to(self.dtype) if tensor.is_floating_point() else tensor

    @contextlib.contextmanager
    def forward_context(self) -> Iterator[None]:
        # Tensors created inside the step (torch.zeros(...), masks) get the module's dtype too.
        previous = torch.get_default_dtype()
        torch.set_default_dtype(self.dtype)
        try:
            yield
        finally:
            torch.set_default_dtype(previous)


class MixedPrecision(Precision):
    """Autocast to float16 ("16-mixed", with a ``GradScaler``) or bfloat16 ("bf16-mixed", no scaler)."""

    wraps_forward = True

    def __init__(self, name: str, dtype: torch.dtype, device_type: str) -> None:
        self.name = name
        self.dtype = dtype
        self.device_type = device_type
        # float16's narrow range makes small gradients underflow; the scaler multiplies the loss up,
        # divides the gradients back, and skips steps whose gradients overflowed.
        self.scaler = torch.amp.GradScaler(device_type) if dtype == torch.float16 else None
        self.scales_gradients = self.scaler is not None
        self._told_of_sync = False
        self._unscaled: set[int] = set()  # the optimizers whose gradients were unscaled since the last step

    def forward_context(self) -> contextlib.AbstractContextManager:
        return torch.autocast(self.device_type, dtype=self.dtype)

    def backward(self, loss: torch.Tensor, backward: Callable[[torch.Tensor], None] | None = None) -> None:
        (backward or torch.Tensor.backward)(loss if self.scaler is None else self.scaler.scale(loss))

    def unscale_gradients(self, optimizer: torch.optim.Optimizer) -> None:
        # Once per step: a module's own clip_gradients may ask again after the loop has unscaled.
        if self.scaler is not None and id(optimizer) not in self._unscaled:
            self.scaler.unscale_(optimizer)
            self._unscaled.add(id(optimizer))

    def optimizer_step(
        self, optimizer: torch.optim.Optimizer, closure: Callable[[], Any] | None = None, **kwargs: Any
    ) -> Any:
        if self.scaler is None:
            return super().optimizer_step(optimizer, closure, **kwargs)
        # The scaler steps (or skips) once it knows the gradients: the closure runs first, once, as in Lightning.
        result = closure() if closure is not None else None
        if not getattr(optimizer, "_step_supports_amp_scaling", False) and not self._told_of_sync:
            self._told_of_sync = True
            rank_zero_warn(
                f"precision='16-mixed' with {type(optimizer).__name__}: the loss scaler skips a step whose "
                "gradients overflowed by reading the overflow flag on the host first, one host-device sync per "
                "step; fused optimizers skip on the device without it: pass fused=True to torch.optim.Adam, "
                "AdamW or SGD"
            )
        # Skipped when the gradients hold inf or NaN: a fused optimizer checks on the device, any other is
        # stepped (or not) after GradScaler reads the overflow flag with .item().
        self.scaler.step(optimizer, **kwargs)
        self.scaler.update()
        self._unscaled.clear()
        return result

    def state_dict(self) -> dict[str, Any]:
        return {"scaler": self.scaler.state_dict()} if self.scaler is not None else {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if self.scaler is not None and "scaler" in state:
            self.scaler.load_state_dict(state["scaler"])


def _warn_float16_on_cpu() -> None:
    if lightning_names_served():  # Lightning's words, at each Trainer as Lightning's (its tests expect it each time)
        rank_zero_warn(
            "You passed `Trainer(accelerator='cpu', precision='16-mixed')` but AMP with fp16 is not supported on "
            "CPU. Using `precision='bf16-mixed'` instead.",
            stacklevel=4,
        )
    else:
        rank_zero_warn_once(
            "precision='16-mixed' needs a GPU (float16 autocast with a GradScaler); "
            "on CPU Ember uses precision='bf16-mixed' instead",
            stacklevel=4,
        )


def build_precision(flag: str | int, device: torch.device) -> Precision:
    """The precision plugin for ``flag`` on ``device``, refusing modes the device cannot run."""
    name = canonical_precision(flag)
    if flag in _HISTORICAL and lightning_names_served():  # Lightning's advice, to the programs that use its names
        rank_zero_warn(
            f"`precision={flag}` is supported for historical reasons but its usage is discouraged. "
            f"Please set your precision to {name} instead!",
            stacklevel=3,
        )
    if name == "16-mixed" and device.type == "cpu":
        _warn_float16_on_cpu()
        name = "bf16-mixed"
    # Emulation does not count: a card that only emulates bfloat16 (V100, T4) runs it many times slower.
    lacks_bf16 = device.type == "cuda" and not torch.cuda.is_bf16_supported(including_emulation=False)
    if name.startswith("bf16") and lacks_bf16:
        raise ValueError(
            f"precision={flag!r}: {torch.cuda.get_device_name(device)} has no bfloat16 support; "
            "use precision='16-mixed' instead"
        )
    if name == "32-true":
        return Precision()
    if name == "64-true":
        return TruePrecision(name, torch.float64)
    if name == "16-true":
        return TruePrecision(name, torch.float16)
    if name == "bf16-true":
        return TruePrecision(name, torch.bfloat16)
    dtype = torch.float16 if name == "16-mixed" else torch.bfloat16
    return MixedPrecision(name, dtype, device.type)
