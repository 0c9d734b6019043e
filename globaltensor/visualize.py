"""Pictures of a layout: which ranks hold which block of a tensor (pure: a Layout in, text out)."""
from __future__ import annotations

from .layout import Layout
from .sbp import format_sbp


def _cell_labels(layout: Layout, rows: int, cols: int, row_of, col_of) -> list[list[str]]:
    """Label every cell of a rows x cols drawing with the ranks whose piece covers it."""
    grid = [[[] for _ in range(cols)] for _ in range(rows)]
    for coord in layout.placement.coords():
        rank = layout.placement.rank_at(coord)
        box = layout.box(coord)
        r0, r1 = box[0] if layout.ndim >= 1 else (0, 1)
        c0, c1 = box[1] if layout.ndim >= 2 else (0, 1)
        for i in range(rows):
            for j in range(cols):
                if r0 <= row_of(i) < r1 and c0 <= col_of(j) < c1:
                    grid[i][j].append(str(rank))
    return [[",".join(cell) if cell else "-" for cell in line] for line in grid]


def draw(layout: Layout, max_rows: int = 16, max_cols: int = 16) -> str:
    """A text drawing: one cell per element (or per block of elements for big tensors), naming the
    ranks that hold it. Tensors of more than 2 dims are drawn over their first two dims."""
    shape = layout.shape
    n_rows = shape[0] if layout.ndim >= 1 else 1
    n_cols = shape[1] if layout.ndim >= 2 else 1
    rows, cols = min(max(n_rows, 1), max_rows), min(max(n_cols, 1), max_cols)

    def row_of(i):
        return i * n_rows // rows

    def col_of(j):
        return j * n_cols // cols

    labels = _cell_labels(layout, rows, cols, row_of, col_of) if n_rows and n_cols else []
    width = max([len(c) for line in labels for c in line] + [1])
    head = (f"{format_sbp(layout.sbp)} on {layout.placement!r}, global shape {list(shape)}"
            + ("  (value = sum over the P axes)" if layout.is_partial else ""))
    lines = [head]
    if rows < n_rows or cols < n_cols:
        lines.append(f"(drawn at {rows}x{cols}; each cell stands for a block of elements)")
    lines += [" ".join(c.rjust(width) for c in line) for line in labels]
    lines.append("pieces:")
    for coord in layout.placement.coords():
        rank = layout.placement.rank_at(coord)
        box = ", ".join(f"{a}:{b}" for a, b in layout.box(coord))
        lines.append(f"  rank {rank} at {coord}: [{box}]  local shape {list(layout.local_shape(coord))}")
    return "\n".join(lines)


def visualize(x, max_rows: int = 16, max_cols: int = 16, **unknown) -> str:
    """``gt.visualize(x)``: the drawing of a global tensor's layout (no communication)."""
    from .errors import GlobalTensorError

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
