"""Operators on global tensors: one module per op family, each owning its rows, its kernels
and its size rewrites, registered with one ``register(...)`` line per op or group of ops.

    signature.py   Row, Rule, Call, Ref, KEEP; sig()/table(); the registry: OPS[name] -> OpEntry
                   (rule, kernels, rewrite, decompose, mutates, write-back, factory role);
                   register(); describe(op) prints an entry
    choose.py      candidates over the grid, move + backward cost, Choice
    pointwise.py  creation.py  random_ops.py  sampling.py  reductions.py  matmul.py  views.py
    indexing.py  nn.py  norms.py  losses.py

Adding an op family is one new module here: every module of the package is imported below, so
its ``register(...)`` lines run (see docs/architecture.md). Nothing in ``ops/`` imports ``tensor``
or ``dispatch``: kernels get what they need through :class:`signature.KernelContext`.
"""
import importlib
import pkgutil

from .choice.backward import backward_cost, grad_layout
from .choice.candidates import outs_of
from .choice.choose import MOVES, Choice, choose
from .signature import (B, KEEP, KERNELS, LOCAL, NUMBER, OPS, P, S, Call, KernelContext, OpEntry,
                        Ref, Row, Rule, arg_value, describe, entry, factory_roles, fit, qualified,
                        register, rows_for, rule_for, sig, table)
from .views import view_groups

for _module in pkgutil.iter_modules(__path__):  # the op families: each registers its ops
    importlib.import_module(f"{__name__}.{_module.name}")

__all__ = ["B", "P", "S", "KEEP", "LOCAL", "MOVES", "NUMBER", "OPS", "Call", "Choice", "KernelContext",
           "OpEntry", "Ref", "Row", "Rule", "arg_value", "KERNELS", "backward_cost", "choose",
           "describe", "entry", "factory_roles", "fit", "grad_layout", "outs_of", "qualified", "register",
           "rows_for", "rule_for", "sig", "table", "view_groups"]
