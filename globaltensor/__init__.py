"""globaltensor: OneFlow-style global tensors (placement + SBP) for PyTorch."""
from . import sbp
from .env import init
from . import env
from .errors import GlobalTensorError
from .layout import Layout
from .placement import Placement, placement

__all__ = [
    "GlobalTensorError",
    "Layout",
    "Placement",
    "env",
    "init",
    "placement",
    "sbp",
]
