"""quire-torch: ``torch.Tensor`` leaves for quire checkpoints.

quire finds the handler through its ``quire.leaf_handlers`` entry point (``torch``);
nothing needs importing.  Importing this package does not import torch.
"""

from __future__ import annotations

from quire_torch._handler import TorchTensorHandler

__all__ = ["TorchTensorHandler"]
__version__ = "0.1.0"
