"""New values shaped like an input: ``*_like``, ``fill``, ``zero``, ``new_*``.

    B    -> B        the input's layout, full values
    P    -> B        a P input still gives a full value (it is only read for its shape)
    S(d) -> S(d)
    *    -> B        ``new_zeros(size)`` & co: the input is only read for dtype and device

And the torch factories that global mode (``mode/global_mode.py``) turns into global ones, by their role
(``factory=``): "same", computed alike on every rank, whole, then this rank's piece kept;
"uniform" / "normal", the size from the call and the values from gt's random stream (the same
on every rank); "first", the first rank's draw, sent to the others.
"""
from __future__ import annotations

from .rules import B, S, Call, Row, sig

from .registry import register


def like(call: Call) -> tuple[Row, ...]:
    """``*_like``: a new full value shaped like the input; a P input gives a B output. The
    random ones (``rand_like`` & co) draw values consistent with the sbp (kernel "random")."""
    nd = len(call.shapes[0])
    kernel = "random" if call.packet.startswith("rand") else None
    rows = [sig("B -> B", kernel), sig("P -> B", kernel)]
    rows += [Row((S(d),), (S(d),), kernel) for d in range(nd)]
    # fill(self, value) with a 0-dim global value (fill_ / y[1:3] = v): the value whole, as B
    extra = (B,) * (len(call.shapes) - 1)
    return tuple(Row(r.ins + extra, r.outs, r.kernel) for r in rows)


def new_full(call: Call) -> tuple[Row, ...]:
    """``new_zeros(size)`` & co: a new B tensor; the input is only read for dtype and device."""
    return (sig("* -> B"),) if len(call.shapes) == 1 else ()


register("zeros_like", "ones_like", "empty_like", "full_like", rule=like, order_free=True)
register("fill", "fill_", "zero", "zero_", rule=like, order_free=True)
register("new_zeros", "new_ones", "new_empty", "new_full", "new_empty_strided", rule=new_full)

# global mode: factories whose result is the same on every rank
register("arange", "range", "zeros", "ones", "full", "empty", "eye", "tensor", "as_tensor",
         "asarray", "linspace", "logspace", "empty_strided", "scalar_tensor", "tril_indices",
         "triu_indices", "from_numpy", "zeros_like", "ones_like", "full_like", "empty_like",
         factory="same")
# random factories: size from the call, values from gt's stream (same on every rank)
register("rand", "rand_like", factory="uniform")
register("randn", "randn_like", factory="normal")
# other random factories: the first rank's draw, sent to the others
register("randperm", "randint", "randint_like", "normal", "poisson", "bernoulli", "multinomial",
         factory="first")
