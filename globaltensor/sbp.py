"""SBP values: how a logical tensor is laid out along one placement axis.

``split(dim)`` (S): each rank along the axis holds a slice of ``dim``;
``broadcast`` (B): each holds the whole; ``partial_sum`` (P): the value is the sum of the locals.
"""
from __future__ import annotations

from dataclasses import dataclass
from collections.abc import Mapping, Sequence
from typing import Any, Iterable, Union

from .errors import SbpError


HEAD_TAIL = "head_tail"
BALANCES = (HEAD_TAIL,)


@dataclass(frozen=True, slots=True)
class Split:
    """``S(dim)``; with ``balance="head_tail"`` the permuted split of causal load balance: over k
    ranks, rank i's piece (the uneven rule's size) holds chunk i of the dim's 2k chunks, then
    chunk 2k-1-i (its first half, rounded up, is the head; docs/long_context.md)."""

    dim: int
    balance: str | None = None

    def __post_init__(self):
        if isinstance(self.dim, bool) or not isinstance(self.dim, int):
            raise SbpError(
                f"split(dim) expects an int dim, found {self.dim!r} ({type(self.dim).__name__}); "
                f"write e.g. gt.sbp.split(0)"
            )
        if self.balance is not None and self.balance not in BALANCES:
            raise SbpError(
                f"split(dim, balance=...) expects one of {list(BALANCES)} or None, found "
                f"{self.balance!r}; write e.g. gt.sbp.split(1, balance=\"head_tail\")")

    def __repr__(self):
        return f"S({self.dim})" if self.balance is None else f"S({self.dim}, {self.balance})"

    __str__ = __repr__

    def resolve(self, ndim: int) -> "Split":
        """This split with a negative dim normalised against a tensor of ``ndim`` dims."""
        if not -ndim <= self.dim < ndim:
            raise SbpError(
                f"split({self.dim}) needs a tensor dim in [{-ndim}, {ndim}), found a tensor with "
                f"{ndim} dims; pick a dim the tensor has"
            )
        return Split(self.dim % ndim, self.balance) if self.dim < 0 else self

    @property
    def plain(self) -> "Split":
        """This split without its balance (the piece sizes are the same)."""
        return self if self.balance is None else Split(self.dim)


@dataclass(frozen=True, slots=True)
class Broadcast:
    def __repr__(self):
        return "B"

    __str__ = __repr__

    def resolve(self, ndim: int) -> "Broadcast":
        return self


@dataclass(frozen=True, slots=True)
class PartialSum:
    def __repr__(self):
        return "P"

    __str__ = __repr__

    def resolve(self, ndim: int) -> "PartialSum":
        return self


SbpValue = Union[Split, Broadcast, PartialSum]
# what an ``sbp=`` argument takes: one value (a 1-D placement), one per placement axis, or
# ``{axis: value}`` with the axes it leaves out broadcast
SbpSpec = Union[SbpValue, Sequence[SbpValue], Mapping[Any, SbpValue]]
SBP_TYPES = (Split, Broadcast, PartialSum)

broadcast = Broadcast()
partial_sum = PartialSum()


def replicated(ndim: int) -> tuple:
    """The sbp of a value every rank holds whole: B on each of ``ndim`` placement axes."""
    return (broadcast,) * ndim
# OneFlow spells these as B / P too
B = broadcast
P = partial_sum


def split(dim: int | None = None, *, axis: int | None = None,
          balance: str | None = None) -> Split:
    """``split(dim)``: each rank along the placement axis holds a slice of tensor dim ``dim``.
    ``split(axis=1)`` is OneFlow's spelling of ``split(1)`` (its keyword; the tensor dim, not a
    placement axis). ``balance="head_tail"``: the permuted split that balances causal attention
    (rank i of k holds chunks i and 2k-1-i of the dim's 2k; see :class:`Split`)."""
    if (dim is None) == (axis is None):
        found = "neither" if dim is None else f"both dim={dim!r} and axis={axis!r}"
        raise SbpError(f"gt.sbp.split expects one tensor dim, as split(1) or OneFlow's "
                       f"split(axis=1), found {found}; pass one of them")
    return Split(dim if axis is None else axis, balance)


def S(dim: int, balance: str | None = None) -> Split:
    """``S(dim)``: the short spelling of ``split(dim)``, as sbps print (``S(1, "head_tail")``)."""
    return Split(dim, balance)


def balanced(values) -> bool:
    """Whether any of the sbp ``values`` is a balanced (permuted) split."""
    return any(type(v) is Split and v.balance is not None for v in values)


def plain(values) -> tuple:
    """The sbp ``values`` with every split's balance dropped."""
    return tuple(v.plain if type(v) is Split else v for v in values)


def _one(value) -> SbpValue:
    if isinstance(value, SBP_TYPES):
        return value
    if value is Broadcast or value is PartialSum:
        return value()
    if value is split:
        raise SbpError("gt.sbp.split needs a dim: write gt.sbp.split(0), not gt.sbp.split")
    raise SbpError(
        f"expected an sbp (gt.sbp.split(dim), gt.sbp.broadcast or gt.sbp.partial_sum), "
        f"found {value!r} ({type(value).__name__})"
    )


def normalize(sbp, ndim: int | None = None, axes: tuple | None = None) -> tuple[SbpValue, ...]:
    """One sbp or a list/tuple of them -> a tuple; with ``ndim``, check one entry per placement axis.

    A single B or P given for an n-D placement means that value on every axis (``B`` alone is
    a full copy on every rank, as users write it); a single split is ambiguous (which axis
    splits?) and an error naming the axes and the dict form. A dict ``{axis: sbp}`` names axes by
    name (``axes``, the placement's axis names) or by number; the axes it leaves out are
    broadcast.
    """
    if isinstance(sbp, Mapping):
        return by_axis(sbp, ndim, axes)
    if isinstance(sbp, (list, tuple)):
        values = tuple(_one(v) for v in sbp)
    else:
        one = _one(sbp)
        if ndim is not None and ndim > 1 and not isinstance(one, Split):
            return (one,) * ndim
        if ndim is not None and ndim > 1:
            names = list(axes) if axes else list(range(ndim))
            first = repr(names[0])
            example = format_sbp([one] + ["B"] * (ndim - 1))
            raise SbpError(
                f"expected one sbp per placement axis ({ndim} axes: {names}), found one split, "
                f"{one}, which does not say which axis splits; pass a tuple like {example} or "
                f"name the axis: {{{first}: {one}}} (the axes left out are broadcast)")
        values = (one,)
    if not values:
        raise SbpError("expected at least one sbp, found an empty sequence")
    if ndim is not None and len(values) != ndim:
        shown = "(" + ", ".join(str(v) for v in values) + ")"
        example = format_sbp(["gt.sbp.broadcast"] * ndim)
        raise SbpError(
            f"expected {ndim} sbp value{'' if ndim == 1 else 's'}, one per placement axis, found "
            f"{len(values)}: {shown}; pass a tuple like {example}"
        )
    return values


def by_axis(sbp: Mapping, ndim: int | None, axes: tuple | None) -> tuple[SbpValue, ...]:
    """``{"tp": S(0)}`` (or ``{1: S(0)}``) -> one value per placement axis, B where not named."""
    if ndim is None:
        raise SbpError(f"an sbp by axis, {dict(sbp)!r}, needs the placement it is for")
    values = list(replicated(ndim))
    for key, value in sbp.items():
        values[_axis_index(key, ndim, axes, sbp)] = _one(value)
    return tuple(values)


def _axis_index(key, ndim: int, axes: tuple | None, sbp: Mapping) -> int:
    if isinstance(key, int) and not isinstance(key, bool) and 0 <= key < ndim:
        return key
    if axes is not None and key in axes:
        return axes.index(key)
    named = f"named {list(axes)}" if axes else "unnamed (name them with gt.placement(..., axes=(...)))"
    raise SbpError(
        f"sbp {dict(sbp)!r}: expected placement axes {list(range(ndim))} or their names, found "
        f"{key!r}; this placement's axes are {named}")


def resolve(values: Iterable[SbpValue], ndim: int) -> tuple[SbpValue, ...]:
    """Normalise negative split dims against a tensor of ``ndim`` dims."""
    return tuple(v.resolve(ndim) for v in values)


def format_sbp(values) -> str:
    """Compact form, the tuple a user would write: ``(S(0), B)``, and ``(S(0),)`` for one axis."""
    values = tuple(values)
    return "(" + ", ".join(str(v) for v in values) + (",)" if len(values) == 1 else ")")

_BALANCED_CODE = 1 << 16  # S(d, head_tail): d + this


def to_codes(values) -> tuple[int, ...]:
    """Resolved sbp values as ints (S(d): d, S(d, head_tail): d + 65536, B: -1, P: -2): what
    torch.compile's opaque calls can take as constants."""
    return tuple((v.dim + (_BALANCED_CODE if v.balance else 0)) if isinstance(v, Split)
                 else (-2 if isinstance(v, PartialSum) else -1) for v in values)


def from_codes(codes) -> tuple[SbpValue, ...]:
    """The sbp values :func:`to_codes` gave."""
    return tuple((Split(c) if c < _BALANCED_CODE else Split(c - _BALANCED_CODE, "head_tail"))
                 if c >= 0 else (partial_sum if c == -2 else broadcast) for c in codes)


__all__ = ["Split", "Broadcast", "PartialSum", "SbpValue", "SbpSpec", "broadcast", "partial_sum",
           "replicated",
           "B", "P", "split", "S", "balanced", "plain", "normalize", "format_sbp", "SbpError"]
