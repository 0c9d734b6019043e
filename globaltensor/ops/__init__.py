"""Operators on global tensors: one module per op family, each owning its rows, its kernels
and its size rewrites, registered with one ``register(...)`` line per op or group of ops.

    rules.py       Row, Rule, Call, Ref, KEEP; sig()/table()/fit(); broadcasting frames
    registry.py    OPS[name] -> OpEntry (rule, kernels, rewrite, decompose, mutates, write-back,
                   factory role); register(); rows_for(call); describe(op); KernelContext
    naming.py      the keys of ops: torch's spellings of an op, custom ops with their namespace
    pieces.py      which pieces of a row belong together; zeros only where exact
    ring.py        ring attention's kernel: key/value chunks shifted around an axis
    choice/        the signature choice (choose, candidates, backward): the only part that
                   imports ``plan``
    the families:  pointwise  activations  creation  random_ops  sampling  reductions
                   matmul  views  shapes  indexing  embedding_bag  linalg  spatial  nn  norms
                   losses  recurrent  unsupported

Adding an op family is one new module here: every module of the package is imported below, so
its ``register(...)`` lines run (see docs/architecture.md). Nothing in ``ops/`` imports ``tensor``
or ``dispatch``: kernels get what they need through :class:`registry.KernelContext`.
"""
import importlib
import pkgutil

from .choice.backward import backward_cost, grad_layout
from .choice.candidates import outs_of
from .choice.choose import MOVES, Choice, choose
from .rules import B, KEEP, LOCAL, NUMBER, P, S, Call, Ref, Row, Rule, arg_value, fit, sig, table
from .naming import qualified
from .registry import (KERNELS, OPS, KernelContext, OpEntry, describe, entry, factory_roles, register,
                       rows_for, rule_for)
from .views import view_groups

for _module in pkgutil.iter_modules(__path__):  # the op families: each registers its ops
    importlib.import_module(f"{__name__}.{_module.name}")

__all__ = ["B", "P", "S", "KEEP", "LOCAL", "MOVES", "NUMBER", "OPS", "Call", "Choice", "KernelContext",
           "OpEntry", "Ref", "Row", "Rule", "arg_value", "KERNELS", "backward_cost", "choose",
           "describe", "entry", "factory_roles", "fit", "grad_layout", "outs_of", "qualified", "register",
           "rows_for", "rule_for", "sig", "table", "view_groups"]
