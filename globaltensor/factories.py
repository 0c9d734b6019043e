"""Factories: each rank computes only its own piece of the global tensor (``randperm`` aside: a
piece of a permutation depends on all of it, so every rank computes the whole permutation).

``partial_sum`` layouts: the value sits on coordinate 0 of every partial axis and the other ranks
hold zeros, so the sum of the pieces is the value.
"""
from __future__ import annotations

import math
import numbers

import torch

from . import debug as _debug
from . import env, observe, random
from .errors import GlobalTensorError
from .layout import Layout
from .pieces import piece_of, positions
from .convert import check_placement, device_for
from .runtime.agreement import check
from .tensor import GlobalTensor
from .world.simulated import knowable, simulated


def _size(size) -> tuple[int, ...]:
    if len(size) == 1 and isinstance(size[0], (tuple, list, torch.Size)):
        size = tuple(size[0])
    for s in size:
        if isinstance(s, bool) or not isinstance(s, int) or s < 0:
            raise GlobalTensorError(
                f"expected a size of non-negative ints, found {list(size)!r}; e.g. gt.zeros(4, 5, ...)"
            )
    return tuple(size)


def _checked_dtype(dtype):
    if dtype is not None and not isinstance(dtype, torch.dtype):
        raise GlobalTensorError(
            f"expected dtype to be a torch.dtype (e.g. torch.float32) or None, found {dtype!r} "
            f"({type(dtype).__name__})"
        )
    return dtype


def _checked_number(value, what: str):
    if isinstance(value, torch.Tensor) and value.dim() == 0 and not value.is_global:
        return value.item()
    if not isinstance(value, numbers.Number):
        raise GlobalTensorError(
            f"expected {what} to be a number, found {repr(value)[:80]} ({type(value).__name__})"
        )
    return value


def _fits(value, dtype, what: str):
    """``value`` as torch would store it in ``dtype``: a clear error where it does not fit."""
    try:
        torch.full((), value, dtype=dtype)
    except (OverflowError, RuntimeError, TypeError) as e:
        raise GlobalTensorError(
            f"expected {what} to fit in {dtype}, found {value!r} ({type(e).__name__}: {e}); pass "
            f"a value in its range or a wider dtype") from None
    return value


def _size_sequence(size, op: str) -> tuple:
    if not isinstance(size, (tuple, list, torch.Size)):
        raise GlobalTensorError(
            f"{op} expects size as a tuple or list of ints, found {size!r}; "
            f"write e.g. gt.{op}(({size!r},), ...)"
        )
    return (tuple(size),)


def _layout(size, placement, sbp) -> Layout:
    if placement is None or sbp is None:
        raise GlobalTensorError(
            "global factories need placement= and sbp=, e.g. gt.zeros(4, 5, placement="
            f"gt.placement('cpu', [0, 1]), sbp=gt.sbp.split(0)); found placement={placement!r}, "
            f"sbp={sbp!r}"
        )
    placement = check_placement(placement)
    return Layout(placement, sbp, size)  # the Layout normalises the sbp


def _holds_value(layout: Layout, coord) -> bool:
    """On partial axes only coordinate 0 holds the value; the others hold zeros."""
    return all(coord[a] == 0 for a in layout.partial_axes)


def _checked_flag(value, what: str) -> bool:
    if not isinstance(value, bool):
        raise GlobalTensorError(f"expected {what} to be True or False, found "
                                f"{repr(value)[:80]} ({type(value).__name__})")
    return value


def _finish(local: torch.Tensor, layout: Layout, coord, requires_grad: bool) -> GlobalTensor:
    if _checked_flag(requires_grad, "requires_grad") and not (local.dtype.is_floating_point
                                                           or local.dtype.is_complex):
        raise GlobalTensorError(
            f"requires_grad=True needs a floating point or complex dtype, found {local.dtype}; "
            f"pass dtype=torch.float32 or leave requires_grad off"
        )
    if _debug.is_debug():
        check("gt." + _debug.caller(__name__), layout=layout, dtype=local.dtype,
                     requires_grad=requires_grad)
    if coord is not None and not _holds_value(layout, coord):
        local = torch.zeros_like(local)
    out = GlobalTensor._make(local, layout)
    if simulated():  # counted on every rank by its piece (the meta piece was this rank's only)
        observe.storage_kind(out, "activations")
    return out.requires_grad_(requires_grad) if requires_grad else out


def _make(fill, size, placement, sbp, dtype, requires_grad):
    """``fill(local_shape, dtype, device)`` builds this rank's piece."""
    layout = _layout(_size(size), placement, sbp)
    coord = layout.placement.coord_of(env.get_rank())
    device = device_for(layout.placement)
    dtype = _checked_dtype(dtype) or torch.get_default_dtype()
    shape = layout.local_shape(coord) if coord is not None else (0,) * layout.ndim
    return _finish(fill(shape, dtype, device), layout, coord, requires_grad)


def zeros(*size, placement=None, sbp=None, dtype=None, requires_grad=False) -> GlobalTensor:
    """A global tensor of zeros of global shape ``size``; each rank allocates only its piece.

    >>> x = gt.zeros(8, 4, placement=gt.placement("cpu", [0, 1]), sbp=gt.sbp.split(0))
    """
    return _make(lambda s, d, dev: torch.zeros(s, dtype=d, device=dev), size, placement, sbp,
                 dtype, requires_grad)


def ones(*size, placement=None, sbp=None, dtype=None, requires_grad=False) -> GlobalTensor:
    """A global tensor of ones of global shape ``size``; each rank allocates only its piece.

    >>> x = gt.ones(8, 4, placement=gt.placement("cpu", [0, 1]), sbp=gt.sbp.broadcast)
    """
    return _make(lambda s, d, dev: torch.ones(s, dtype=d, device=dev), size, placement, sbp,
                 dtype, requires_grad)


def empty(*size, placement=None, sbp=None, dtype=None, requires_grad=False) -> GlobalTensor:
    """An uninitialised global tensor of global shape ``size`` (each rank's piece only).

    >>> x = gt.empty(8, 4, placement=gt.placement("cpu", [0, 1]), sbp=gt.sbp.split(0))
    """
    return _make(lambda s, d, dev: torch.empty(s, dtype=d, device=dev), size, placement, sbp,
                 dtype, requires_grad)


def full(size, fill_value, *, placement=None, sbp=None, dtype=None,
         requires_grad=False) -> GlobalTensor:
    """A global tensor of global shape ``size`` filled with ``fill_value`` (int64 for an int,
    bool for a bool, as torch.full).

    >>> x = gt.full((8, 4), 7.0, placement=gt.placement("cpu", [0, 1]), sbp=gt.sbp.split(0))
    """
    size, fill_value = _size_sequence(size, "full"), _checked_number(fill_value, "fill_value")
    if dtype is None and isinstance(fill_value, bool):
        dtype = torch.bool
    elif dtype is None and isinstance(fill_value, int):
        dtype = torch.int64
    _fits(fill_value, _checked_dtype(dtype) or torch.get_default_dtype(), "full's fill_value")
    return _make(lambda s, d, dev: torch.full(s, fill_value, dtype=d, device=dev), size,
                 placement, sbp, dtype, requires_grad)


def _random(piece, size, placement, sbp, dtype, requires_grad):
    layout = _layout(_size(size), placement, sbp)
    coord = layout.placement.coord_of(env.get_rank())
    dtype = _checked_dtype(dtype) or torch.get_default_dtype()
    local = piece(layout, coord, dtype, device_for(layout.placement))
    return _finish(local, layout, coord, requires_grad)


def _floating(dtype, op: str):
    if dtype is not None and isinstance(dtype, torch.dtype) and not dtype.is_floating_point:
        raise GlobalTensorError(
            f"gt.{op} expects a floating point dtype, found {dtype} (torch.{op} raises for it "
            f"too); use gt.randint for integers, or cast: gt.{op}(...).to({dtype})")
    return dtype


def rand(*size, placement=None, sbp=None, dtype=None, requires_grad=False) -> GlobalTensor:
    """U[0, 1) values of global shape ``size``, the same for a given gt.manual_seed whatever the
    placement or sbp; each rank draws only its piece."""
    _floating(dtype, "rand")
    return _random(random.uniform_piece, size, placement, sbp, dtype, requires_grad)


def randn(*size, placement=None, sbp=None, dtype=None, requires_grad=False) -> GlobalTensor:
    """N(0, 1) values of global shape ``size``, the same for a given gt.manual_seed whatever the
    placement or sbp; each rank draws only its piece."""
    _floating(dtype, "randn")
    return _random(random.normal_piece, size, placement, sbp, dtype, requires_grad)


def randint(low, high=None, size=None, *, placement=None, sbp=None, dtype=torch.int64,
            requires_grad=False) -> GlobalTensor:
    """Integers in [low, high) (``randint(high, size, ...)`` also works, as in torch)."""
    if size is None:
        low, high, size = 0, low, high
    if size is None or high is None or high <= low:
        raise GlobalTensorError(
            f"randint expects low < high and a size, found low={low}, high={high}, size={size}"
        )
    size = _size_sequence(size, "randint")
    for bound, what in ((low, "low"), (high, "high")):
        _fits(bound, torch.int64, f"randint's {what}")

    def piece(layout, coord, dt, device):
        return random.randint_piece(low, high, layout, coord, dtype, device)

    return _random(piece, size, placement, sbp, dtype, requires_grad)


def arange(start, end=None, step=1, *, placement=None, sbp=None, dtype=None,
           requires_grad=False) -> GlobalTensor:
    """``arange`` as in torch; each rank computes the values of its own index range."""
    if end is None:
        start, end = 0, start
    start, end, step = (_checked_number(v, f"arange's {w}")
                        for v, w in ((start, "start"), (end, "end"), (step, "step")))
    _checked_dtype(dtype)
    if step == 0:
        raise GlobalTensorError("arange expects a non-zero step, found 0")
    if not all(math.isfinite(v) for v in (start, end, step)):
        raise GlobalTensorError(f"arange expects finite start, end and step, found start={start}, "
                                f"end={end}, step={step}; pass finite numbers")
    n = max(0, math.ceil((end - start) / step))
    layout = _layout((n,), placement, sbp)
    coord = layout.placement.coord_of(env.get_rank())
    is_int = all(isinstance(v, int) for v in (start, end, step))
    dtype = dtype or (torch.int64 if is_int else torch.get_default_dtype())
    index = positions(layout, coord, 0, torch.int64 if is_int else torch.float64)
    local = _placed((start + step * index).to(dtype), layout)
    return _finish(local, layout, coord, requires_grad)


def _checked_count(n, what: str) -> int:
    if isinstance(n, bool) or not isinstance(n, int) or n < 0:
        raise GlobalTensorError(f"{what} expects a non-negative int, found {n!r} ({type(n).__name__})")
    return n


def _indexed(n: int, placement, sbp, requires_grad, values) -> GlobalTensor:
    """A 1-D global tensor of ``n`` values: ``values(index)`` computes the values at the global
    indices of this rank's piece (a 1-D int64 tensor)."""
    layout = _layout((n,), placement, sbp)
    coord = layout.placement.coord_of(env.get_rank())
    local = values(positions(layout, coord, 0))
    return _finish(_placed(local, layout), layout, coord, requires_grad)


def _placed(local: torch.Tensor, layout: Layout) -> torch.Tensor:
    """``local`` on the placement's device (in gt.simulate: meta, unless ``knowable``)."""
    if simulated() and knowable(local):
        return local
    return local.to(device_for(layout.placement))


def _linspace_at(start, end, steps: int, index: torch.Tensor, dtype) -> torch.Tensor:
    """torch's CPU linspace at ``index``: from the start up to halfway, from the end after, in
    the dtype (float64 for an integer dtype, then truncated, as torch)."""
    ct = dtype if (dtype.is_floating_point or dtype.is_complex) else torch.float64
    first, last = torch.tensor(start, dtype=ct), torch.tensor(end, dtype=ct)
    if steps == 1:
        return first.expand(index.shape).to(dtype)
    step = (last - first) / (steps - 1)
    up = first + step * index.to(ct)
    down = last - step * (steps - 1 - index).to(ct)
    return torch.where(index < steps // 2, up, down).to(dtype)


def linspace(start, end, steps, *, placement=None, sbp=None, dtype=None,
             requires_grad=False) -> GlobalTensor:
    """``torch.linspace``: ``steps`` values evenly spaced from ``start`` to ``end``; each rank
    computes the values at its own indices."""
    start = _checked_number(start, "linspace's start")
    end = _checked_number(end, "linspace's end")
    steps = _checked_count(steps, "linspace's steps")
    dtype = _checked_dtype(dtype) or torch.get_default_dtype()
    return _indexed(steps, placement, sbp, requires_grad,
                    lambda i: _linspace_at(start, end, steps, i, dtype))


def logspace(start, end, steps, base=10.0, *, placement=None, sbp=None, dtype=None,
             requires_grad=False) -> GlobalTensor:
    """``torch.logspace``: ``base ** linspace(start, end, steps)`` (computed in float64, then
    cast to ``dtype``); each rank computes the values at its own indices."""
    start = _checked_number(start, "logspace's start")
    end = _checked_number(end, "logspace's end")
    base = _checked_number(base, "logspace's base")
    steps = _checked_count(steps, "logspace's steps")
    dtype = _checked_dtype(dtype) or torch.get_default_dtype()
    ct = torch.complex128 if dtype.is_complex else torch.float64
    return _indexed(steps, placement, sbp, requires_grad, lambda i: torch.pow(
        torch.tensor(base, dtype=ct), _linspace_at(start, end, steps, i, ct)).to(dtype))


def hann_window(window_length, periodic=True, *, placement=None, sbp=None, dtype=None,
                requires_grad=False) -> GlobalTensor:
    """``torch.hann_window``: ``0.5 - 0.5 cos(2 pi n / N)``, N = window_length if periodic else
    window_length - 1 (computed in float64, then cast; one value is [1.]); each rank computes
    the values at its own indices."""
    n = _checked_count(window_length, "hann_window's window_length")
    dtype = _checked_dtype(dtype) or torch.get_default_dtype()
    if not dtype.is_floating_point:
        raise GlobalTensorError(
            f"hann_window expects a floating point dtype, found {dtype}; pass e.g. "
            f"dtype=torch.float32")
    period = n if periodic else n - 1

    def values(i):
        if n == 1:  # a window of one value: [1.], as torch
            return torch.ones(i.shape, dtype=dtype)
        return (0.5 - 0.5 * torch.cos(i.to(torch.float64) * (2 * math.pi / period))).to(dtype)

    return _indexed(n, placement, sbp, requires_grad, values)


def randperm(n, *, placement=None, sbp=None, dtype=torch.int64,
             requires_grad=False) -> GlobalTensor:
    """``torch.randperm``: a random permutation of ``range(n)``, the same for a given
    gt.manual_seed whatever the placement or sbp. Each rank computes the whole permutation
    (O(n log n): a piece of a permutation depends on every element) and keeps its piece."""
    n = _checked_count(n, "randperm's n")
    _checked_dtype(dtype)

    def piece(layout, coord, dt, device):
        return random.permutation_piece(n, layout, coord, dtype, device)

    return _random(piece, (n,), placement, sbp, dtype, requires_grad)


def normal(mean, std, size, *, placement=None, sbp=None, dtype=None,
           requires_grad=False) -> GlobalTensor:
    """``torch.normal(mean, std, size)`` with numbers ``mean`` and ``std``: N(mean, std**2), the
    same global values for a given gt.manual_seed whatever the placement or sbp. (For tensors
    of means or deviations, write ``mean + std * gt.randn_like(mean)``.)"""
    if any(isinstance(v, torch.Tensor) and v.is_global for v in (mean, std)):
        raise GlobalTensorError(
            "gt.normal expects numbers for mean and std, found a global tensor; write "
            "mean + std * gt.randn_like(mean) for tensors of means or deviations")
    mean, std = _checked_number(mean, "normal's mean"), _checked_number(std, "normal's std")
    if std < 0:
        raise GlobalTensorError(f"normal expects std >= 0, found {std}")
    if dtype is not None and not _checked_dtype(dtype).is_floating_point:
        raise GlobalTensorError(
            f"normal expects a floating point dtype, found {dtype}; pass e.g. dtype=torch.float32")
    size = _size_sequence(size, "normal")

    def piece(layout, coord, dt, device):
        return random.normal_piece(layout, coord, torch.float64, device).mul_(std).add_(mean).to(dt)

    return _random(piece, size, placement, sbp, dtype, requires_grad)


def eye(n, m=None, *, placement=None, sbp=None, dtype=None,
        requires_grad=False) -> GlobalTensor:
    """``torch.eye(n, m)``: ones on the diagonal; each rank compares its own rows and columns."""
    n = _checked_count(n, "eye's n")
    m = n if m is None else _checked_count(m, "eye's m")
    layout = _layout((n, m), placement, sbp)
    coord = layout.placement.coord_of(env.get_rank())
    dtype = _checked_dtype(dtype) or torch.get_default_dtype()
    rows, cols = positions(layout, coord, 0).unsqueeze(1), positions(layout, coord, 1).unsqueeze(0)
    local = (rows == cols).to(dtype).to(device_for(layout.placement))
    return _finish(local, layout, coord, requires_grad)


def tensor(data, *, placement=None, sbp=None, dtype=None, requires_grad=False) -> GlobalTensor:
    """A global tensor from the *full* data, given alike on every rank; each rank keeps its piece."""
    try:
        full_value = torch.as_tensor(data, dtype=_checked_dtype(dtype))
    except (TypeError, ValueError, RuntimeError) as e:
        raise GlobalTensorError(
            f"gt.tensor expects data torch.as_tensor accepts (a tensor, a number or a "
            f"rectangular nested list of numbers), found {type(data).__name__}: {e}"
        ) from None
    if isinstance(data, torch.Tensor):
        full_value = full_value.detach()
    layout = _layout(tuple(full_value.shape), placement, sbp)
    coord = layout.placement.coord_of(env.get_rank())
    device = device_for(layout.placement)
    if coord is None:
        local = full_value.new_empty((0,) * full_value.dim())
    else:
        local = piece_of(full_value, layout, coord).clone()
    return _finish(local.to(device), layout, coord, requires_grad)


def _like(fn, x, placement, sbp, dtype, requires_grad, *args):
    placement = placement if placement is not None else getattr(x, "placement", None)
    sbp = sbp if sbp is not None else getattr(x, "sbp", None)
    return fn(*args, tuple(x.shape), placement=placement, sbp=sbp, dtype=dtype or x.dtype,
              requires_grad=requires_grad)


def zeros_like(x, *, placement=None, sbp=None, dtype=None, requires_grad=False) -> GlobalTensor:
    """``gt.zeros`` of ``x``'s shape; placement, sbp and dtype are ``x``'s unless given."""
    return _like(zeros, x, placement, sbp, dtype, requires_grad)


def ones_like(x, *, placement=None, sbp=None, dtype=None, requires_grad=False) -> GlobalTensor:
    """``gt.ones`` of ``x``'s shape; placement, sbp and dtype are ``x``'s unless given."""
    return _like(ones, x, placement, sbp, dtype, requires_grad)


def empty_like(x, *, placement=None, sbp=None, dtype=None, requires_grad=False) -> GlobalTensor:
    """``gt.empty`` of ``x``'s shape; placement, sbp and dtype are ``x``'s unless given."""
    return _like(empty, x, placement, sbp, dtype, requires_grad)


def rand_like(x, *, placement=None, sbp=None, dtype=None, requires_grad=False) -> GlobalTensor:
    """``gt.rand`` of ``x``'s shape; placement, sbp and dtype are ``x``'s unless given."""
    return _like(rand, x, placement, sbp, dtype, requires_grad)


def randn_like(x, *, placement=None, sbp=None, dtype=None, requires_grad=False) -> GlobalTensor:
    """``gt.randn`` of ``x``'s shape; placement, sbp and dtype are ``x``'s unless given."""
    return _like(randn, x, placement, sbp, dtype, requires_grad)


def full_like(x, fill_value, *, placement=None, sbp=None, dtype=None,
              requires_grad=False) -> GlobalTensor:
    """``gt.full`` of ``x``'s shape; placement, sbp and dtype are ``x``'s unless given."""
    placement = placement if placement is not None else getattr(x, "placement", None)
    sbp = sbp if sbp is not None else getattr(x, "sbp", None)
    return full(tuple(x.shape), fill_value, placement=placement, sbp=sbp, dtype=dtype or x.dtype,
                requires_grad=requires_grad)


def randint_like(x, low, high=None, *, placement=None, sbp=None, dtype=None,
                 requires_grad=False) -> GlobalTensor:
    """``gt.randint`` of ``x``'s shape; placement, sbp and dtype are ``x``'s unless given."""
    placement = placement if placement is not None else getattr(x, "placement", None)
    sbp = sbp if sbp is not None else getattr(x, "sbp", None)
    return randint(low, high, tuple(x.shape), placement=placement, sbp=sbp,
                   dtype=dtype or x.dtype, requires_grad=requires_grad)


__all__ = ["zeros", "ones", "empty", "full", "rand", "randn", "randint", "arange", "tensor",
           "linspace", "logspace", "hann_window", "randperm", "normal", "eye",
           "zeros_like", "ones_like", "empty_like", "rand_like", "randn_like", "full_like",
           "randint_like"]
