"""``gt.communication(...)``: what happens when an operator would move an input.

    gt.communication("explicit")          # from here on, in this context (a process's main thread)
    with gt.communication("warn"):        # inside the block only
        y = x @ w

- ``implicit`` (the default): operators redistribute their inputs as their rule needs.
- ``warn``: each redistribution an operator chooses is logged once per (op, layouts, source
  line) on the ``globaltensor`` logger, with the plan and the bytes each rank sends.
- ``explicit``: an operator whose inputs need communication raises ``GlobalTensorError`` on
  every rank before anything is sent, naming the op, the user's line, the layouts, the plan it
  would have run and the fix (``x.to_global(sbp=...)`` before the op).

Always allowed: the collectives the user asks for (``to_global`` and its backward,
``full_tensor()``, ``item()``, printing, ``gt.comm``), the data-parallel gradient reductions
(grads.py) and checkpoints; and plans whose steps are all local (a broadcast input sliced to a
split, or zero-filled to a partial sum), which send nothing. Inside backward the message names
the autograd node and, when the forward ran under ``torch.autograd.detect_anomaly()``, the
forward's line. ``GT_COMMUNICATION=warn|explicit`` sets the policy for every context that has not
set one (read once per context); ``gt.communication(...)`` overrides it.

The check runs where redistributions are observed (observe.py ``redistribution``), so the policy costs
nothing per operator that moves no data, and nothing at all while it is ``implicit``.
"""
from __future__ import annotations

import logging
import sys

import torch
from torch.utils._pytree import tree_leaves

from .. import debug
from ..errors import GlobalTensorError
from ..observe import check_policy, current, plug, reset, set_watchers
from ..sbp import format_sbp

LOG = logging.getLogger("globaltensor")


class communication:  # noqa: N801 - used like a function, as torch.set_grad_enabled is
    """Set the communication policy (``implicit``, ``warn`` or ``explicit``) for this context
    now; used as a context manager, the previous policy comes back at the end of the block.

    >>> with gt.communication("explicit"):
    ...     y = x.to_global(sbp=gt.sbp.broadcast) @ w    # a move asked for: allowed
    ...     z = y + x                                    # would move x: raises
    """

    def __init__(self, mode: str = "implicit"):
        self.mode = check_policy(mode, "gt.communication")
        self._token = set_watchers(policy=self.mode)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        reset(self._token)
        return False

    def __repr__(self):
        return f"gt.communication({self.mode!r})"

    @staticmethod
    def current() -> str:
        """The policy in force in this context."""
        watchers = current()
        return "implicit" if watchers is None else watchers.policy


def on_move(watchers, call: str, plan, local, memo: bool = False) -> None:
    """An observed redistribution under the ``warn`` or ``explicit`` policy (observe.py);
    ``memo``: served from the memo of an earlier move of the tensor (nothing sent now)."""
    if not _operator(call) or not any(s.communicates() for s in plan.steps):
        return  # asked for by the user, a gradient bucket, or local steps only: allowed
    line = debug.user_line(2)
    origin = debug.backward_origin()
    if watchers.policy == "warn":
        key = (call, plan.src, plan.dst, line, origin, memo)
        if key in watchers.warned:
            return
        watchers.warned.add(key)
        LOG.warning(_message(call, line, origin, plan, local, False, memo))
        return
    raise GlobalTensorError(_message(call, line, origin, plan, local, True, memo))


def _operator(call: str) -> bool:
    """Whether ``call`` (debug.user_call) names an operator, "aten.mm.default" or
    "mylib.cube.default", not a collective the user asked for ("to_global", "item()")."""
    return call.count(".") == 2 and " " not in call


def _message(call, line, origin, plan, local, explicit: bool, memo: bool = False) -> str:
    dtype = str(local.dtype).replace("torch.", "")
    where = f"{call} at {line}" + (f" ({origin})" if origin else "")
    steps = plan.describe(local.element_size(), dtype).splitlines()
    head = (f'gt.communication("explicit"): {where} would redistribute an input, '
            if explicit else f'gt.communication("warn"): {where} redistributes an input, ')
    lines = [head + f"{format_sbp(plan.src.sbp)} -> {format_sbp(plan.dst.sbp)} "
             f"(shape {list(plan.src.shape)} {dtype}, {plan.bytes_per_rank(local.element_size())} "
             f"bytes per rank)" + (_MEMO if memo else "."),
             f"  the op's inputs: {_op_inputs()}",
             "  the plan it " + ("would run:" if explicit else "runs:")]
    lines += ["    " + s for s in steps]
    if explicit:
        target = format_sbp(plan.dst.sbp)
        lines.append(
            "Expected no communication chosen by an operator under the explicit policy. Fix: move "
            f"that input yourself before the op, `t = t.to_global(sbp={target})`"
            + (" (inside backward, a gradient: give the forward's move a grad_sbp, "
               "`h.to_global(sbp=..., grad_sbp=...)`, so backward brings it there itself)"
               if origin else "")
            + ", or allow it with gt.communication('warn') / gt.communication('implicit').")
    return "\n".join(lines)


_MEMO = (", served from the memo of an earlier move of this tensor: nothing is sent now, but "
         "the op needs the move, and it sends again once the tensor changes.")


def _op_inputs() -> str:
    """The layouts of the global tensors of the operator being dispatched (read from
    dispatch's frame; only on this error path)."""
    frame = sys._getframe(1)
    while frame is not None:
        if (frame.f_globals.get("__name__") == "globaltensor.dispatch"
                and frame.f_code.co_name == "dispatch"):
            args, kwargs = frame.f_locals.get("args", ()), frame.f_locals.get("kwargs") or {}
            found = [v for v in tree_leaves((args, kwargs)) if isinstance(v, torch.Tensor)]
            return ", ".join(_text(v) for v in found) or "-"
        frame = frame.f_back
    return "-"


def _text(value) -> str:
    layout = getattr(value, "_layout", None)
    kind = format_sbp(layout.sbp) if layout is not None else "local"
    return f"{kind} {list(value.shape)} {str(value.dtype).replace('torch.', '')}"


__all__ = ["communication"]


plug("policy", on_move)  # observe.py calls it for every observed move
