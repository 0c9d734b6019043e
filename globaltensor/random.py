"""Counter-based random numbers for global tensors.

Every value depends only on (seed, offset, global position), never on the placement, the sbp or
the rank: the element at global linear index ``i`` of the ``n``-th random call is
``mix(seed, offset_n + i)``, where ``offset`` advances by the tensor's numel on every rank alike.
So ``gt.manual_seed(s)`` gives the same global values under S(0), S(1), B or (S0, S1), each rank
computes only its own piece, and broadcast replicas get identical values (the same dropout mask).

State lives in a ContextVar (ranks may be threads of one interpreter in tests).
"""
from __future__ import annotations

import contextvars
import math

import torch

from .layout import Layout
from .pieces import piece_of, positions

_MASK64 = (1 << 64) - 1


def _signed(c: int) -> int:
    return c - (1 << 64) if c >= (1 << 63) else c


_GOLDEN = _signed(0x9E3779B97F4A7C15)
_M1 = _signed(0xBF58476D1CE4E5B9)
_M2 = _signed(0x94D049BB133111EB)


class _State:
    __slots__ = ("seed", "offset")

    def __init__(self, seed: int):
        self.seed = seed
        self.offset = 0


_STATE: contextvars.ContextVar = contextvars.ContextVar("globaltensor_random_state", default=None)


def _state() -> _State:
    state = _STATE.get()
    if state is None:
        # never seeded in this context: a fixed seed, the same on every rank (SPMD stays consistent)
        state = _State(0)
        _STATE.set(state)
    return state


def manual_seed(seed: int) -> None:
    """Seed globaltensor's generator (and torch's, for local code). Call it on every rank alike."""
    if isinstance(seed, bool) or not isinstance(seed, int):
        from .errors import GlobalTensorError

        raise GlobalTensorError(f"manual_seed expects an int, found {seed!r} ({type(seed).__name__})")
    if not -2 ** 63 <= seed < 2 ** 64:
        from .errors import GlobalTensorError

        raise GlobalTensorError(f"manual_seed expects a seed in [-2**63, 2**64) (torch's range), "
                                f"found {seed}; pass a smaller seed, e.g. seed % 2**64")
    _STATE.set(_State(seed & _MASK64))
    torch.manual_seed(seed)


def get_state() -> tuple[int, int]:
    s = _state()
    return s.seed, s.offset


def set_state(state: tuple[int, int]) -> None:
    seed, offset = state
    s = _State(seed)
    s.offset = offset
    _STATE.set(s)


def _shr(x: torch.Tensor, k: int) -> torch.Tensor:
    """Logical right shift of int64 bits."""
    return (x >> k) & ((1 << (64 - k)) - 1)


def _mix(x: torch.Tensor) -> torch.Tensor:
    """splitmix64 finaliser on int64 tensors (wrapping arithmetic)."""
    x = x + _GOLDEN
    x = (x ^ _shr(x, 30)) * _M1
    x = (x ^ _shr(x, 27)) * _M2
    return x ^ _shr(x, 31)


def _global_index(layout: Layout, coord, on=None) -> torch.Tensor:
    """Global linear indices (row-major) of the piece at ``coord``, shaped like the piece (a
    head-tail dim: its two ranges' positions, in the piece's order)."""
    index = torch.zeros((), dtype=torch.int64)
    stride = 1
    for d in reversed(range(layout.ndim)):
        along = positions(layout, coord, d, device=on)
        shape = [1] * layout.ndim
        shape[d] = along.numel()
        index = index + along.reshape(shape) * stride
        stride *= layout.shape[d]
    return index.expand(layout.local_shape(coord)) if layout.ndim else index


def _stream_key(seed: int, stream: int) -> torch.Tensor:
    return _mix(torch.tensor(_signed((seed + stream * 0x9E3779B97F4A7C15) & _MASK64), dtype=torch.int64))


def _bits(layout: Layout, coord, stream: int, offset: int, seed: int, on=None) -> torch.Tensor:
    return _mix(_global_index(layout, coord, on) + offset + _stream_key(seed, stream))


def _uniform_from_bits(bits: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    if dtype == torch.float64:
        return _shr(bits, 11).to(torch.float64) * (2.0 ** -53)
    return (_shr(bits, 40).to(torch.float32) * (2.0 ** -24)).to(dtype)


def _advance(numel: int) -> tuple[int, int]:
    """Reserve ``numel`` counters (the same on every rank); return (seed, offset) to use."""
    state = _state()
    offset = state.offset
    state.offset += max(numel, 1)
    return state.seed, offset


def _on(device):
    """Where the draw is computed: on the meta device for a piece without data (every piece
    in gt.simulate: the same steps, no values computed), else on the CPU (then moved)."""
    return "meta" if device is not None and torch.device(device).type == "meta" else None


def uniform_piece(layout: Layout, coord, dtype=torch.float32, device=None) -> torch.Tensor:
    """The piece at ``coord`` of a global U[0, 1) tensor with ``layout``; advances the generator."""
    seed, offset = _advance(layout.numel())
    if coord is None:
        return torch.empty((0,) * layout.ndim, dtype=dtype, device=device)
    u = _uniform_from_bits(_bits(layout, coord, 0, offset, seed, _on(device)), dtype)
    return u.to(device) if device is not None else u


def normal_piece(layout: Layout, coord, dtype=torch.float32, device=None) -> torch.Tensor:
    """The piece at ``coord`` of a global N(0, 1) tensor (Box-Muller over two counter streams)."""
    seed, offset = _advance(layout.numel())
    if coord is None:
        return torch.empty((0,) * layout.ndim, dtype=dtype, device=device)
    u1 = _uniform_from_bits(_bits(layout, coord, 1, offset, seed, _on(device)), torch.float64)
    u2 = _uniform_from_bits(_bits(layout, coord, 2, offset, seed, _on(device)), torch.float64)
    z = torch.sqrt(-2.0 * torch.log1p(-u1)) * torch.cos(2.0 * math.pi * u2)
    z = z.to(dtype)
    return z.to(device) if device is not None else z


def randint_piece(low: int, high: int, layout: Layout, coord, dtype=torch.int64, device=None):
    """The piece at ``coord`` of a global tensor of integers uniform in [low, high)."""
    seed, offset = _advance(layout.numel())
    if coord is None:
        return torch.empty((0,) * layout.ndim, dtype=dtype, device=device)
    u = _uniform_from_bits(_bits(layout, coord, 3, offset, seed, _on(device)), torch.float64)
    v = (low + torch.floor(u * (high - low))).clamp_(max=high - 1).to(dtype)
    return v.to(device) if device is not None else v


def permutation_piece(n: int, layout: Layout, coord, dtype=torch.int64, device=None):
    """The piece at ``coord`` of a global random permutation of ``range(n)``. A permutation's
    piece depends on every element, so each rank computes the whole permutation alike, as the
    stable argsort of ``n`` counter-based keys (global positions 0..n-1), and keeps its piece:
    O(n log n) on every rank, the same permutation whatever the layout."""
    seed, offset = _advance(n)
    if coord is None:
        return torch.empty((0,) * layout.ndim, dtype=dtype, device=device)
    keys = _mix(torch.arange(n, dtype=torch.int64, device=_on(device)) + offset +
                _stream_key(seed, 4))
    perm = piece_of(torch.argsort(keys, stable=True), layout, coord).to(dtype)
    return perm.to(device) if device is not None else perm


def poisson_from_uniform(u: torch.Tensor, rates: torch.Tensor) -> torch.Tensor:
    """Poisson draws with ``rates`` from uniforms ``u`` (float64, broadcast together), by
    inversion: the smallest ``k`` with ``P(X <= k) = Q(k + 1, rate) > u``, found by bisection
    (``Q`` the regularised upper incomplete gamma, ``torch.special.gammaincc``). Exact up to
    float64 rounding; the search stops 12 standard deviations past the rate (mass below 1e-30)."""
    if bool((rates < 0).any()):
        raise RuntimeError("invalid Poisson rate, expected rate to be non-negative")  # torch's
    rate, u = torch.broadcast_tensors(rates.to(torch.float64), u)
    lo = torch.zeros_like(rate)
    hi = torch.ceil(rate + 12 * torch.sqrt(rate) + 24)
    while bool((lo < hi).any()):
        mid = torch.floor((lo + hi) / 2)
        above = torch.special.gammaincc(mid + 1, rate) > u
        hi = torch.where(above, mid, hi)
        lo = torch.where(above, lo, mid + 1)
    return lo.to(rates.dtype)


def rand_local(layout: Layout, dtype=torch.float32, device=None, rank: int | None = None):
    """This rank's piece of a global U[0, 1) tensor consistent with ``layout``'s sbp.

    Broadcast and partial replicas get identical values (a dropout mask is the same on every rank
    that holds the same block). Every rank of the world must call it, in the same order.
    """
    if rank is None:
        from . import env

        rank = env.get_rank()
    return uniform_piece(layout, layout.placement.coord_of(rank), dtype, device)

__all__ = ["manual_seed", "get_state", "set_state"]
