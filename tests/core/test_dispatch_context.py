"""Signatures chosen with their backward in mind, checked on the choice itself (pure): moving an
input that will get a gradient also costs the move its gradient needs (ops.backward_cost) and
moves already made are free (on ranks: tests/ranks/test_dispatch_context_ranks.py)."""
import pytest

from globaltensor import ops
from globaltensor.layout import Layout
from globaltensor.plan import DEFAULT, plan
from globaltensor.ops import B, P, S, Call, Ref

from helpers import G2, G22


# ----------------------------------------------------------------------------- pure


def test_grad_layout_follows_the_signature():
    dst = Layout(G22, (S(0), P), (8, 4))
    assert ops.grad_layout(dst, ((S(0), P),)).sbp == (S(0), B)     # P: the same on every term
    dst = Layout(G22, (B, B), (8, 4))
    assert ops.grad_layout(dst, ((B, B),)).sbp == (B, B)           # replicated: replicated
    assert ops.grad_layout(dst, ((S(1), B),)).sbp == (P, B)        # a part per rank: partial


def test_backward_cost_is_a_gather_after_a_reduce_scatter_and_nothing_after_an_all_reduce():
    src = Layout(G2, (P,), (64, 32))
    to_split, to_full = src.with_sbp((S(0),)), src.with_sbp((B,))
    gather = plan(to_split, to_full).cost(4)
    assert ops.backward_cost(src, to_split, ((S(0),),), 4) == pytest.approx(gather)
    assert ops.backward_cost(src, to_full, ((B,),), 4) == 0.0
    # all-gathered for mm with a column-split weight: the gradient is partial, reduce-scattered
    x = Layout(G2, (S(0),), (64, 32))
    rs = plan(x.with_sbp((P,)), x).cost(4)
    assert ops.backward_cost(x, x.with_sbp((B,)), ((S(1),),), 4) == pytest.approx(rs)
    # a B source takes its gradient in any layout (as partial sums): a slice costs nothing more
    w = Layout(G2, (B,), (64, 32))
    assert ops.backward_cost(w, w.with_sbp((S(0),)), ((S(0),),), 4) == 0.0


def _mse_call(shape):
    return Call("mse_loss.default", (shape, shape), (Ref(0), Ref(1)), (), frozenset())


def test_a_partial_input_that_gets_a_gradient_is_all_reduced_not_reduce_scattered():
    shape = (64, 256)
    out, target = Layout(G22, (S(0), P), shape), Layout(G22, (S(0), B), shape)
    with_grad = ops.choose(_mse_call(shape), (out, target), (4, 4), grads=(True, False))
    assert with_grad.ins[0].sbp == (S(0), B) and with_grad.outs == ((P, B),)
    # a reduce_scatter sends half the bytes for this op, but leaves the loss partial on the
    # tensor axis too (a second reduction owed) and its gradient to gather in backward
    scattered = (out.with_sbp((S(0), S(1))), target.with_sbp((S(0), S(1))))
    rs = ops.choose(_mse_call(shape), scattered, (4, 4))
    assert rs.outs == ((P, P),)
    rs_ag = (plan(out, scattered[0]).cost(4) + rs.cost
             + ops.backward_cost(out, scattered[0], rs.outs, 4))
    assert with_grad.cost < rs_ag
    greedy = ops.choose(_mse_call(shape), (out, target), (4, 4))
    assert greedy.ins[0].sbp == (S(0), B)  # without a gradient too: the owed reduction decides
    # a move already made is free: backward (no grad mode) keeps forward's choice
    free = (frozenset({out.with_sbp((S(0), B))}), frozenset())
    again = ops.choose(_mse_call(shape), (out, target), (4, 4), free=free)
    assert again.ins[0].sbp == (S(0), B) and again.cost == DEFAULT.alpha  # the loss, owed


def test_without_moves_the_context_changes_nothing():
    shape = (8, 4)
    x = Layout(G22, (S(0), B), shape)
    for grads in ((), (True, True)):
        choice = ops.choose(_mse_call(shape), (x, x), (4, 4), grads=grads)
        assert choice.ins == (x, x) and choice.cost == DEFAULT.alpha  # the loss's sum, owed
