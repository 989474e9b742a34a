"""What the emulated device cannot know of cuDNN: the workspace each convolution takes.

On a real GPU cuDNN chooses each convolution's algorithm on the device (heuristics, or
benchmarking with ``torch.backends.cudnn.benchmark``) and PyTorch gives it a workspace from the
caching allocator for the call (``at::native::run_conv_plan``), as large as the chosen plan
asks. None of that is a tensor the script makes, nor a size it follows from, so the
prediction has no workspace to place: on an H200 a BatchNorm CNN step's peak allocated matched
within 2.25% while its peak reserved was 28% below the real run's (1.59 against 2.22 GiB; the
cuDNN workspaces reached 250 MiB, see docs/predict.md). So a script that ran convolutions on the
emulated device is told so on a line of its own (``ConvolutionCount``, one of the session's op
hooks), rather than given a bound that would be a guess.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["CONVOLUTION_OPS", "ConvolutionCount"]

# What nn.Conv*d and F.conv*d reach below autograd, forward and backward; cuDNN runs both on CUDA.
CONVOLUTION_OPS = frozenset({torch.ops.aten.convolution.default, torch.ops.aten.convolution_backward.default})


class ConvolutionCount:
    """An op hook for ``PredictSession.op_hooks``: counts the convolutions run on the emulated
    CUDA device and changes nothing (it always answers ``NotImplemented``)."""

    def __init__(self) -> None:
        self.convolutions = 0

    def __call__(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        if func in CONVOLUTION_OPS and torch.backends.cudnn.enabled:
            first = args[0] if args else None
            if isinstance(first, torch.Tensor) and first.device.type == "cuda":
                self.convolutions += 1
        return NotImplemented

    def note(self) -> str | None:
        """The line predict prints of it, None when no convolution ran on the GPU."""
        if not self.convolutions:
            return None
        return (f"not modelled: cuDNN's convolution workspaces ({self.convolutions:,} convolution calls, forward "
                "and backward): cuDNN picks each one's algorithm and workspace on the real GPU, so peak reserved "
                "can be well above this prediction (a BatchNorm CNN on an H200: 2.22 GiB real, 1.59 GiB "
                "predicted; allocated within 2.25%); see docs/predict.md, 'Against real GPUs'")
