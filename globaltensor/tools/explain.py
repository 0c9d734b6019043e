"""``gt.explain``: the plan a redistribution would run, with bytes per rank (no communication)."""
from __future__ import annotations

from ..convert import target_layout
from ..errors import GlobalTensorError
from ..plan import cost, plan
from ..tensor import GlobalTensor


class Explanation:
    """A plan bound to a dtype: ``str()`` prints one step per line, then the modelled time and
    the cost figures it was chosen under; ``.steps`` holds the steps, ``.costs`` the figures
    (``gt.costs()`` when it was explained), ``.seconds`` the modelled time."""

    __slots__ = ("plan", "itemsize", "dtype_name", "costs")

    def __init__(self, plan, itemsize: int, dtype_name: str):
        self.plan, self.itemsize, self.dtype_name = plan, itemsize, dtype_name
        self.costs = cost.current()

    @property
    def seconds(self) -> float:
        return self.plan.cost(self.itemsize)

    @property
    def steps(self):
        return self.plan.steps

    @property
    def bytes_per_rank(self) -> int:
        return self.plan.bytes_per_rank(self.itemsize)

    @property
    def collectives(self) -> int:
        return self.plan.collectives()

    def __len__(self):
        return len(self.plan.steps)

    def __iter__(self):
        return iter(self.plan.steps)

    def __str__(self):
        return (f"{self.plan.describe(self.itemsize, self.dtype_name)}\n"
                f"modelled: {self.seconds * 1e6:.3g} us under {self.costs}")

    __repr__ = __str__


def explain(x, placement=None, sbp=None) -> Explanation:
    """The plan ``x.to_global(placement, sbp)`` would run: steps, axes, dims, bytes per rank.

    >>> print(gt.explain(x, sbp=gt.sbp.broadcast))
    (S(0),) -> (B,)  on placement('cpu', ranks=[0, 1])  shape [4, 5] float32
      1. all_gather ...
    """
    if not isinstance(x, GlobalTensor):
        raise GlobalTensorError(
            f"explain expects a global tensor, found {type(x).__name__}; make one with "
            f"x.to_global(placement=..., sbp=...)"
        )
    dst = target_layout(x._layout, placement, sbp, "explain")
    return Explanation(plan(x._layout, dst), x.element_size(), str(x.dtype).replace("torch.", ""))

__all__ = ["explain", "Explanation"]
