"""Pictures of a layout: which ranks hold which block of a tensor (pure: a Layout in, text out)."""
from __future__ import annotations

from ..layout import Layout
from ..sbp import format_sbp


def _blocks(layout: Layout, dim: int) -> list[tuple[int, int]]:
    """The [start, stop) ranges of ``dim`` between consecutive piece boundaries: within one,
    every element is held by the same ranks (one dim of size 1 for a tensor without it)."""
    if dim >= layout.ndim:
        return [(0, 1)]
    cuts = {0, layout.shape[dim]}
    for coord in layout.placement.coords():
        for piece in layout.ranges(coord)[dim]:  # (two for a head-tail split)
            cuts.update(piece)
    cuts = sorted(cuts)
    return list(zip(cuts, cuts[1:]))


def _label(layout: Layout, row: tuple[int, int], col: tuple[int, int]) -> str:
    """The ranks whose piece covers the block ``row`` x ``col`` (first two dims)."""
    held = []
    for coord in layout.placement.coords():
        ranges = layout.ranges(coord)
        if all(_covers(ranges[d] if layout.ndim > d else ((0, 1),), block)
               for d, block in enumerate((row, col))):
            held.append(str(layout.placement.rank_at(coord)))
    return ",".join(held) if held else "-"


def _covers(pieces, block: tuple[int, int]) -> bool:
    return any(lo <= block[0] and block[1] <= hi and lo < hi for lo, hi in pieces)


def _span(block: tuple[int, int]) -> str:
    a, b = block
    return str(a) if b == a + 1 else f"{a}:{b}"


def _table(layout: Layout, rows, cols) -> list[str]:
    """One cell per block: rows labelled by their index ranges, columns too."""
    labels = [[_label(layout, r, c) for c in cols] for r in rows]
    head = [_span(c) for c in cols]
    side = [_span(r) for r in rows]
    width = max([len(x) for line in labels for x in line] + [len(h) for h in head])
    lead = max(len(x) for x in side)
    lines = [" " * lead + "  " + " ".join(h.rjust(width) for h in head)] if layout.ndim >= 2 else []
    lines += [side[i].rjust(lead) + "  " + " ".join(x.rjust(width) for x in line)
              for i, line in enumerate(labels)]
    return lines


def draw(layout: Layout, max_rows: int = 16, max_cols: int = 16) -> str:
    """A text drawing over the first two dims: one cell per block of elements held by the same
    ranks (rows and columns labelled with their index ranges), naming those ranks; then every
    rank's box. At most ``max_rows`` x ``max_cols`` blocks are drawn (the first ones)."""
    shape = layout.shape
    rows, cols = _blocks(layout, 0), _blocks(layout, 1)
    head = (f"{format_sbp(layout.sbp)} on {layout.placement!r}, global shape {list(shape)}"
            + ("  (value = sum over the P axes)" if layout.is_partial else ""))
    lines = [head]
    if rows and cols:
        lines += _table(layout, rows[:max_rows], cols[:max_cols])
    if len(rows) > max_rows or len(cols) > max_cols:
        lines.append(f"(the first {min(len(rows), max_rows)}x{min(len(cols), max_cols)} of "
                     f"{len(rows)}x{len(cols)} blocks)")
    lines.append("pieces:")
    for coord in layout.placement.coords():
        rank = layout.placement.rank_at(coord)
        box = ", ".join("+".join(f"{a}:{b}" for a, b in dim) for dim in layout.ranges(coord))
        lines.append(f"  rank {rank} at {coord}: [{box}]  local shape {list(layout.local_shape(coord))}")
    return "\n".join(lines)


def visualize(x, max_rows: int = 16, max_cols: int = 16, **unknown) -> str:
    """``gt.visualize(x)``: the drawing of a global tensor's layout (no communication)."""
    from ..errors import GlobalTensorError

    if unknown:
        raise GlobalTensorError(f"visualize takes x, max_rows and max_cols, found "
                                f"{sorted(unknown)}; e.g. gt.visualize(x, max_rows=8)")
    for name, value in (("max_rows", max_rows), ("max_cols", max_cols)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise GlobalTensorError(f"expected {name} to be an int >= 1, found "
                                    f"{repr(value)[:80]} ({type(value).__name__})")
    layout = getattr(x, "_layout", x)
    if not isinstance(layout, Layout):
        raise GlobalTensorError(
            f"visualize expects a global tensor or a Layout, found {type(x).__name__}; "
            f"make one with x.to_global(placement=..., sbp=...)"
        )
    return draw(layout, max_rows, max_cols)

__all__ = ["visualize", "draw"]
