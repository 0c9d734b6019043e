"""How ``gt.verify`` compares a global op's result with the same op on the full tensors.

Per element, a value passes when ``|out - ref| <= atol + rtol * |ref| + FLOOR_FACTOR * floor``,
where ``ref`` is the op on the full tensors in the op's own dtype and ``floor`` (the *rounding
floor*) is the largest difference between that reference and the same op computed in float64:
what rounding alone moves this op's result by. A distributed op adds its partial sums in another
order than one device does, so its result may differ from the reference by about the floor; a
wrong rule or a wrong input differs by far more. Integers, booleans and shapes compare exactly;
NaN equals NaN and an infinity equals itself. The floor is computed only where a value fails the
first test (and always in report mode).

Default tolerances (rtol, atol) per dtype, torch.testing.assert_close's own; override with
``gt.verify(rtol=..., atol=...)``.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

TOLERANCES = {
    torch.float64: (1e-7, 1e-7),
    torch.float32: (1.3e-6, 1e-5),
    torch.float16: (1e-3, 1e-5),
    torch.bfloat16: (1.6e-2, 1e-5),
    torch.complex128: (1e-7, 1e-7),
    torch.complex64: (1.3e-6, 1e-5),
}
FLOOR_FACTOR = 4.0  # how many rounding floors a result may differ by


@dataclass(frozen=True, slots=True)
class Diff:
    """How one output differs from its reference."""

    ok: bool
    max_abs: float = 0.0
    max_rel: float = 0.0          # max_abs over the largest |reference| value
    floor: float | None = None    # the rounding floor (None: not computed or not a float)
    ratio: float = 0.0            # the worst error over what the tolerance allows (sorting)
    note: str = ""                # a shape or kind that differs

    def text(self) -> str:
        if self.note:
            return self.note
        floor = "n/a" if self.floor is None else f"{self.floor:.1e}"
        return f"max abs error {self.max_abs:.2e}, max rel error {self.max_rel:.2e}, rounding floor {floor}"


def tolerance(dtype: torch.dtype, rtol: float | None, atol: float | None) -> tuple[float, float]:
    """(rtol, atol) for ``dtype``: the given ones, else the dtype's default; 0 for exact dtypes."""
    default = TOLERANCES.get(dtype, (0.0, 0.0))
    return (default[0] if rtol is None else rtol), (default[1] if atol is None else atol)


def compare(out, ref, rtol=None, atol=None, floor=lambda: None) -> Diff:
    """``out`` (the global op's full result) against ``ref``; ``floor()`` gives the rounding
    floor of this output when it is needed."""
    if isinstance(ref, torch.Tensor) or isinstance(out, torch.Tensor):
        if not (isinstance(ref, torch.Tensor) and isinstance(out, torch.Tensor)):
            return Diff(False, math.inf, math.inf, note=f"a {type(out).__name__} instead of a "
                        f"{type(ref).__name__}")
        return _tensors(out, ref, rtol, atol, floor)
    if isinstance(ref, (bool, int, float, complex)) and isinstance(out, (bool, int, float, complex)):
        return _tensors(torch.tensor(out), torch.tensor(ref), rtol, atol, floor)
    if out == ref:
        return Diff(True)
    return Diff(False, math.inf, math.inf, note=f"{out!r} instead of {ref!r}")


def _tensors(out: torch.Tensor, ref: torch.Tensor, rtol, atol, floor) -> Diff:
    if tuple(out.shape) != tuple(ref.shape):
        return Diff(False, math.inf, math.inf, note=f"shape {list(out.shape)} instead of "
                    f"{list(ref.shape)}")
    if out.numel() == 0:
        return Diff(True)
    exact = not (ref.is_floating_point() or ref.is_complex())
    o, r = _wide(out.detach()), _wide(ref.detach())
    same = (o == r) | (torch.isnan(o) & torch.isnan(r)) if not exact else (o == r)
    err = torch.where(same, torch.zeros((), dtype=torch.float64), (o - r).abs().double())
    err = torch.nan_to_num(err, nan=math.inf)
    biggest = float(r.abs().double().nan_to_num(0.0, 0.0, 0.0).max())
    max_abs = float(err.max())
    max_rel = max_abs / biggest if biggest > 0 else (0.0 if max_abs == 0 else math.inf)
    if exact:
        return Diff(max_abs == 0, max_abs, max_rel, None, max_abs)
    rt, at = tolerance(ref.dtype, rtol, atol)
    allowed = at + rt * r.abs().double().nan_to_num(0.0, 0.0, 0.0)
    bad = err > allowed
    fl = None
    if bad.any():
        fl = floor()
        if fl:
            allowed = allowed + FLOOR_FACTOR * fl
            bad = err > allowed
    ratio = float((err / allowed.clamp_min(1e-300)).max())
    return Diff(not bool(bad.any()), max_abs, max_rel, fl, ratio)


def _wide(t: torch.Tensor) -> torch.Tensor:
    t = t.cpu()
    if t.is_complex():
        return t.to(torch.complex128)
    if t.is_floating_point():
        return t.double()
    return t.long()


def floor_of(ref, ref64) -> float | None:
    """The rounding floor of one output: the largest |ref - ref64| (None when not floating)."""
    if not (isinstance(ref, torch.Tensor) and isinstance(ref64, torch.Tensor)):
        return None
    if not (ref.is_floating_point() or ref.is_complex()) or ref.shape != ref64.shape:
        return None
    if ref.numel() == 0:
        return 0.0
    diff = (_wide(ref) - _wide(ref64)).abs().double().nan_to_num(0.0, 0.0, 0.0)
    return float(diff.max())


def widened(value):
    """A floating tensor in float64 (complex in complex128), anything else as it is."""
    if isinstance(value, torch.Tensor) and (value.is_floating_point() or value.is_complex()):
        return value.to(torch.complex128 if value.is_complex() else torch.float64)
    return value


__all__ = ["TOLERANCES", "FLOOR_FACTOR", "Diff", "compare", "tolerance", "floor_of", "widened"]
