"""What a ``Module`` offers besides training: its device type, freezing it, exporting it (TorchScript, ONNX)."""

from __future__ import annotations

import importlib.util
import os
from typing import TYPE_CHECKING, Any, BinaryIO

import torch
from torch import nn

from ember import _utils

if TYPE_CHECKING:
    from typing_extensions import Self


class ExportMixin(nn.Module):
    """``on_gpu``, ``freeze``/``unfreeze``, ``example_input_array``, ``to_torchscript``, ``to_onnx``: Lightning's."""

    #: An input of ``forward`` (a tensor; a tuple of positional arguments; a dict of keyword arguments): the model
    #: summary shows each layer's input and output sizes for it, and ``to_torchscript(method="trace")`` traces it.
    example_input_array: Any = None

    if TYPE_CHECKING:

        @property
        def device(self) -> torch.device: ...

        def on_before_batch_transfer(self, batch: Any, dataloader_idx: int) -> Any: ...
        def transfer_batch_to_device(self, batch: Any, device: torch.device, dataloader_idx: int) -> Any: ...
        def on_after_batch_transfer(self, batch: Any, dataloader_idx: int) -> Any: ...

    #: Lightning's Fabric, which runs a module without a Trainer: Ember has none, so it is always None.
    fabric: None = None

    @property
    def on_gpu(self) -> bool:
        """Whether the module runs on a CUDA device."""
        return self.device.type == "cuda"

    def freeze(self) -> Self:
        """No gradients for any parameter, and evaluation mode; returns the module."""
        for parameter in self.parameters():
            parameter.requires_grad_(False)
        return self.eval()

    def unfreeze(self) -> Self:
        """Gradients for every parameter, and training mode; returns the module."""
        for parameter in self.parameters():
            parameter.requires_grad_(True)
        return self.train()

    @torch.no_grad()
    def to_torchscript(
        self,
        file_path: str | os.PathLike[str] | None = None,
        method: str | None = "script",
        example_inputs: Any = None,
        **kwargs: Any,
    ) -> Any:
        """The module compiled by ``torch.jit.script`` (``method="script"``) or traced by ``torch.jit.trace``
        (``method="trace"``, on ``example_inputs`` or else ``example_input_array``, moved to the module's device),
        in evaluation mode; the module keeps its own mode. Saved to ``file_path`` when given. ``kwargs`` go to the
        ``torch.jit`` function."""
        mode = self.training
        if method == "script":
            with _utils.tracing_graph():
                script = torch.jit.script(self.eval(), **kwargs)
        elif method == "trace":
            if example_inputs is None:
                if self.example_input_array is None:
                    raise ValueError(
                        "Choosing method=`trace` requires either `example_inputs` or `model.example_input_array` "
                        "to be defined."
                    )
                example_inputs = self.example_input_array
            if kwargs.get("check_inputs") is not None:
                kwargs["check_inputs"] = self._to_device(kwargs["check_inputs"])
            with _utils.tracing_graph():
                script = torch.jit.trace(self.eval(), self._to_device(example_inputs), **kwargs)
        else:
            raise ValueError(f"The 'method' parameter only supports 'script' or 'trace', but value given was: {method}")
        self.train(mode)
        if file_path is not None:
            with open(file_path, "wb") as file:
                torch.jit.save(script, file)
        return script

    @torch.no_grad()
    def to_onnx(
        self, file_path: str | os.PathLike[str] | BinaryIO | None = None, input_sample: Any = None, **kwargs: Any
    ) -> Any:
        """``torch.onnx.export`` of the module (which needs the ``onnx`` package) on ``input_sample``, or else
        ``example_input_array``, moved to the module's device; ``kwargs`` go to ``torch.onnx.export``, whose result
        it returns. The module keeps its mode."""
        if importlib.util.find_spec("onnx") is None:
            raise ModuleNotFoundError(f"`{type(self).__name__}.to_onnx()` requires `onnx` to be installed.")
        if input_sample is None:
            if self.example_input_array is None:
                raise ValueError(
                    "Could not export to ONNX since neither `input_sample` nor `model.example_input_array` attribute "
                    "is set."
                )
            input_sample = self.example_input_array
        mode = self.training
        # torch declares a path only, but writes to a file object too (Lightning passes a BytesIO through).
        exported = torch.onnx.export(self, self._to_device(input_sample), file_path, **kwargs)  # type: ignore[arg-type]
        self.train(mode)
        return exported

    def _to_device(self, inputs: Any) -> Any:
        """``inputs`` through the batch transfer hooks, on the module's device, as a batch would be."""
        inputs = self.on_before_batch_transfer(inputs, 0)
        inputs = self.transfer_batch_to_device(inputs, self.device, 0)
        return self.on_after_batch_transfer(inputs, 0)
