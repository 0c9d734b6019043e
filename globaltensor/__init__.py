"""globaltensor: OneFlow-style global tensors (placement + SBP) for PyTorch."""
from ._version import __version__
from typing import TYPE_CHECKING as _TYPE_CHECKING

from . import _startup

# the launcher's own process (python -m globaltensor, launch.py) needs none of this, nor torch
if _TYPE_CHECKING or not _startup.launcher_only():
    from . import sbp
    from .env import init, print0
    from . import env
    from . import comm
    from . import nn
    from .debug import set_debug
    from .errors import GlobalTensorError
    from .tools.explain import explain
    from .runtime.costs import costs, measure as measure_costs, set_costs
    from .layout import Layout
    from .placement import Placement, placement
    from .tensor import GlobalTensor
    from .factories import (arange, empty, empty_like, eye, full, full_like, hann_window, linspace,
                            logspace, normal, ones, ones_like, rand, rand_like, randint,
                            randint_like, randn, randn_like, randperm, tensor, zeros, zeros_like)
    from .random import manual_seed
    from .mode.global_mode import global_mode
    from .launch.spawn import spawn
    from .tools.trace import comm_trace
    from .tools.policy import communication
    from .tools.verify import verify
    from .tools.visualize import visualize
    from .tools.balance import attention_balance
    from .ops.nn import set_attention_method
    from .nn.experts import set_experts_method
    from .sim.memory import memory
    from .sim import simulate
    from . import auto
    from .auto import auto_layout
    from .convert import from_local, install_tensor_methods
    from .mode import pydata
    from .grads import install_grad_methods
    from .nn.module import install_module_methods
    from . import checkpoint
    from . import data
    from .runtime.failure import install_exception_report

    install_tensor_methods()
    # p["tp"]: the placement is pure and never asks which rank runs; indexing it does
    Placement.__getitem__ = env.sub_placement
    pydata.install()
    install_grad_methods()
    install_module_methods()
    checkpoint.install_checkpoint_methods()
    install_exception_report()  # a rank whose program raises names itself in every rank's error

__all__ = [
    "GlobalTensor",
    "auto", "auto_layout",
    "attention_balance", "set_attention_method", "set_experts_method",
    "GlobalTensorError",
    "costs",
    "explain",
    "from_local",
    "global_mode",
    "arange", "empty", "empty_like", "eye", "full", "full_like", "hann_window", "linspace",
    "logspace", "manual_seed", "memory", "simulate", "normal", "ones", "ones_like", "rand", "rand_like", "randint",
    "randint_like", "randn", "randn_like", "randperm", "tensor", "visualize", "zeros",
    "zeros_like",
    "Layout",
    "Placement",
    "checkpoint",
    "comm",
    "comm_trace",
    "communication",
    "data",
    "env",
    "nn",
    "init",
    "placement",
    "print0",
    "measure_costs",
    "sbp",
    "set_costs",
    "set_debug",
    "spawn",
    "verify",
]
