"""``gt.auto_layout``'s answer: a :class:`Table` of :class:`Row` s, best first, printable and
appliable (``table[0].apply(model)``, ``table[0].code()``)."""
from __future__ import annotations

import math
from dataclasses import dataclass, field

from ..errors import GlobalTensorError
from .space import Layout

__all__ = ["Row", "Table", "gib"]


def gib(n) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**27 else f"{n / 2**20:.1f} MiB"


def _secs(s: float) -> str:
    return f"{s:.3g} s" if s >= 1 else f"{s * 1e3:.3g} ms"


@dataclass
class Row:
    """One layout: ``fits`` (its peak within the budget), ``peak`` bytes on its worst rank and
    ``kinds`` there (parameters, gradients, optimizer, activations, communication), ``sent``
    {axis: bytes per step} of the slowest rank, ``step`` (the estimate: ``total``, ``compute``,
    ``communication`` per axis, ``bubble``), ``status`` (how it was found) and ``layout``."""

    layout: Layout
    fits: bool
    peak: int
    kinds: dict
    sent: dict
    step: object
    status: str
    verified: bool = False
    skipped: bool = False
    blocks: object = field(default=None, repr=False)

    def order(self):
        pruned = self.step is None
        return (not self.fits, self.skipped, pruned,
                self.step.total if self.step is not None else math.inf, self.peak)

    def apply(self, model, grid=None):
        """Lay ``model`` out as this row says (``to_global``, ``fully_shard``, checkpointing,
        a ``gt.nn.Pipeline``); returns the model, or the Pipeline when pp > 1. ``grid``: the
        device type ("cuda", "cpu"; default: cuda where there is one), or a placement of the
        world's ranks in order (its device type is used). A model built on meta is then
        ``to_empty``'d and initialised by the user (docs/big_models.md)."""
        import torch

        from ..placement import Placement
        from .build import Blocks, apply

        if isinstance(grid, Placement):
            if grid.ranks.flatten().tolist() != list(range(self.layout.world)):
                raise GlobalTensorError(
                    f"{self.layout}: expected a placement of ranks 0..{self.layout.world - 1} in "
                    f"order, found {grid!r}; pass the device type (\"cuda\") instead")
            grid = grid.type
        device = grid or ("cuda" if torch.cuda.is_available() else "cpu")
        return apply(model, self.layout, device, Blocks(model))

    def code(self, model_name: str = "model", device: str = "cuda") -> str:
        """The calls :meth:`apply` makes, as Python to paste (``model_name`` the model's
        variable, ``device`` the placements' device type)."""
        from .build import code

        if self.blocks is None:
            raise GlobalTensorError("code(): this row does not know the model's blocks; call it "
                                    "on a row of gt.auto_layout's table")
        return code(self.layout, self.blocks, model_name, device)

    def __str__(self) -> str:
        if self.step is None:
            return f"{self.layout}: {self.status}"
        comm = ", ".join(f"{a or 'no axis'} {gib(b)}" for a, b in sorted(
            self.sent.items(), key=lambda kv: str(kv[0])))
        return (f"{self.layout}: {'fits' if self.fits else 'does not fit'}, peak {gib(self.peak)} "
                f"({', '.join(f'{k} {gib(v)}' for k, v in self.kinds.items())}), step "
                f"{_secs(self.step.total)} (compute {_secs(self.step.compute)}), sends "
                f"{comm or 'nothing'}; {self.status}")


class Table:
    """The rows, best first: the fitting ones by estimated step time (the first verified by a
    simulation of the whole model), then those that do not fit by peak, then those not
    simulated (a faster variant fits) and those pruned by the bound."""

    def __init__(self, rows, blocks, budget: int, world: int):
        self.rows, self.budget, self.world = list(rows), budget, world
        for r in self.rows:
            r.blocks = blocks

    def __getitem__(self, i):
        return self.rows[i]

    def __len__(self) -> int:
        return len(self.rows)

    def __iter__(self):
        return iter(self.rows)

    @property
    def fitting(self) -> list[Row]:
        return [r for r in self.rows if r.fits]

    def __str__(self) -> str:
        head = (f"gt.auto_layout: {self.world} ranks, {gib(self.budget)} per rank; "
                f"{len(self.fitting)} of {len(self.rows)} layouts fit")
        lines = [head, f"{'#':>3}  {'layout':<44} {'fits':>4} {'peak':>11} {'step':>9}  "
                 f"{'sends per step':<36} how"]
        for i, r in enumerate(self.rows):
            if r.step is None:
                continue
            sent = ", ".join(f"{a or '-'} {gib(b)}" for a, b in sorted(
                r.sent.items(), key=lambda kv: str(kv[0])))
            lines.append(f"{i:>3}  {str(r.layout):<44} {'yes' if r.fits else 'no':>4} "
                         f"{gib(r.peak):>11} {_secs(r.step.total):>9}  {sent[:36]:<36} "
                         f"{r.status}")
        quiet = [r for r in self.rows if r.step is None]
        if quiet:
            kinds = {"by the memory bound": "alone need", "a more sharded layout of the same "
                     "degrees does not fit": "does not fit", "by the time bound": "cannot beat"}
            counts = {k: sum(1 for r in quiet if v in r.status) for k, v in kinds.items()}
            lines.append(f"     and {len(quiet)} not simulated: " + ", ".join(
                f"{n} {k}" for k, n in counts.items() if n))
        return "\n".join(lines)

    __repr__ = __str__
