"""gt.communication on thread-ranks: a Megatron attention + MLP block written with explicit
to_global moves runs under "explicit" (and matches one process); the same block without them
raises at its first op that would communicate, naming it; "warn" logs once per (op, layouts,
line); collectives the user asks for and data-parallel gradient reductions are always allowed."""
import logging

import pytest
import torch
import torch.nn.functional as F

import globaltensor as gt
from globaltensor.testing import run_ranks

S, B, P = gt.sbp.split, gt.sbp.broadcast, gt.sbp.partial_sum
TP = gt.placement("cpu", [0, 1])
D, H, FF = 8, 4, 16
SBP = {"wq": S(1), "wk": S(1), "wv": S(1), "wo": S(0), "w1": S(1), "w2": S(0)}


def weights():
    g = torch.Generator().manual_seed(0)
    shapes = {"wq": (D, D), "wk": (D, D), "wv": (D, D), "wo": (D, D), "w1": (D, FF), "w2": (FF, D)}
    return {n: torch.randn(*s, generator=g) * 0.3 for n, s in shapes.items()}


X = torch.randn(2, 5, D, generator=torch.Generator().manual_seed(1))


def block(x, p, explicit, f=True):
    """Pre-norm attention then MLP, Megatron layout: column-parallel q/k/v and w1 (S(1)),
    row-parallel wo and w2 (S(0)). ``explicit``: the all-reduces written out, as Megatron's
    f (identity forward, all-reduce of the gradient; left out with ``f=False``) and g
    (all-reduce forward)."""
    b, s, _ = x.shape
    h = F.layer_norm(x, (D,))
    if explicit and f:
        h = h.to_global(sbp=B, grad_sbp=B)                  # f
    q, k, v = ((h @ p[n]).view(b, s, H, D // H).transpose(1, 2) for n in ("wq", "wk", "wv"))
    att = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    a = att.transpose(1, 2).reshape(b, s, D) @ p["wo"]     # a partial sum
    if explicit:
        a = a.to_global(sbp=B)                              # g
    x = x + a
    h = F.layer_norm(x, (D,))
    if explicit and f:
        h = h.to_global(sbp=B, grad_sbp=B)                  # f
    m = F.gelu(h @ p["w1"]) @ p["w2"]
    if explicit:
        m = m.to_global(sbp=B)                              # g
    return x + m


def _globals():
    p = {n: gt.tensor(t, placement=TP, sbp=SBP[n]).requires_grad_(True) for n, t in weights().items()}
    return p, gt.tensor(X, placement=TP, sbp=B)


def test_explicit_block_runs_under_explicit_and_matches_one_process():
    ref_p = {n: t.requires_grad_(True) for n, t in weights().items()}
    ref = block(X, ref_p, False)
    ref.sum().backward()

    def body(rank):
        p, x = _globals()
        with gt.comm_trace() as t, gt.communication("explicit"):
            y = block(x, p, True)
            y.sum().backward()
        return y.full_tensor(), {n: w.grad.full_tensor() for n, w in p.items()}, \
            {r.op for r in t}, t.counts()

    for y, grads, calls, counts in run_ranks(body, 2, timeout=120):
        torch.testing.assert_close(y, ref, rtol=1e-5, atol=1e-5)
        for n, g in grads.items():
            torch.testing.assert_close(g, ref_p[n].grad, rtol=1e-4, atol=1e-5)
        assert calls == {"to_global", "backward of to_global"}  # every move was asked for
        assert counts["all_reduce"] >= 3


def test_the_block_without_explicit_moves_raises_at_its_first_op():
    def body(rank):
        p, x = _globals()
        with gt.communication("explicit"):
            try:
                block(x, p, False)
            except gt.GlobalTensorError as error:
                return str(error)

    messages = run_ranks(body, 2, timeout=60)
    assert messages[0] == messages[1]
    text = messages[0]
    # `x = x + a` (B + P) defers the reduction (docs/planner.md, "Deferred reductions"): the
    # first op that communicates is the norm that reads the sum
    assert text.startswith('gt.communication("explicit"): aten.native_layer_norm.default at ')
    assert "test_communication_policy.py:" in text and "(`h = F.layer_norm(x, (D,))`)" in text
    assert "would redistribute an input, (P,) -> (B,)" in text
    assert "the op's inputs: (P,) [2, 5, 8] float32" in text
    assert "1. all_reduce" in text and "t = t.to_global(sbp=(B,))" in text


class _Records(logging.Handler):
    def __init__(self):
        super().__init__()
        self.messages = []

    def emit(self, record):
        self.messages.append(record.getMessage())


def test_warn_logs_once_per_op_layouts_and_line():
    handler = _Records()
    logging.getLogger("globaltensor").addHandler(handler)

    def body(rank):
        x = gt.ones(4, 6, placement=TP, sbp=S(0))
        with gt.communication("warn"):
            for _ in range(3):
                y = gt.ones(4, 6, placement=TP, sbp=S(1))  # a new tensor: moved again
                z = x + y                                   # the same op, layouts and line
            z = z + gt.ones(4, 6, placement=TP, sbp=S(1))   # another line
        return z.full_tensor()

    try:
        for z in run_ranks(body, 2, timeout=60):
            assert torch.equal(z, torch.full((4, 6), 3.0))
    finally:
        logging.getLogger("globaltensor").removeHandler(handler)
    warned = [m for m in handler.messages if m.startswith('gt.communication("warn")')]
    assert len(warned) == 4  # two lines, on each of the two ranks
    assert sum("(`z = x + y " in m for m in warned) == 2
    assert all("bytes per rank" in m and "the plan it runs:" in m for m in warned)


def test_a_move_served_from_the_memo_is_reported_too():
    """issue 41: a move an op needs, served from the memo of an earlier move of the same tensor
    (nothing sent now), was not reported: a second op on the same inputs passed explicit."""
    handler = _Records()
    logging.getLogger("globaltensor").addHandler(handler)

    def body(rank):
        x = gt.ones(4, 6, placement=TP, sbp=S(0))
        y = gt.ones(4, 6, placement=TP, sbp=S(1))
        z = x + y                                   # implicit: y moved, the move remembered
        with gt.communication("warn"):
            w = x * y                               # the memo serves y's move
        with gt.communication("explicit"):
            try:
                x - y
            except gt.GlobalTensorError as e:
                return w.full_tensor(), z.full_tensor(), str(e)
        return w.full_tensor(), z.full_tensor(), "no error"

    try:
        for w, z, error in run_ranks(body, 2, timeout=60):
            assert torch.equal(w, torch.ones(4, 6)) and torch.equal(z, torch.full((4, 6), 2.0))
            assert "would redistribute an input" in error and "served from the memo" in error
            assert "(`x - y`)" in error
    finally:
        logging.getLogger("globaltensor").removeHandler(handler)
    warned = [m for m in handler.messages if m.startswith('gt.communication("warn")')]
    assert len(warned) == 2 and all("served from the memo" in m and "(`w = x * y" in m
                                    for m in warned)


def test_asked_for_collectives_and_gradient_buckets_are_allowed():
    def body(rank):
        gt.communication("explicit")  # a setting for this context, not only a block
        model = torch.nn.Linear(6, 3)
        torch.manual_seed(0)
        model.to_global(TP, B)
        x = gt.randn(8, 6, placement=TP, sbp=S(0))
        model(x).pow(2).mean().backward()                    # data parallel: gradient buckets
        b = x.to_global(sbp=B)
        shown = str(x)                                       # printing gathers
        total = x.to_global(sbp=B).sum().item()
        one = torch.ones(1)
        gt.comm.all_reduce(one)
        policy = gt.communication.current()
        try:
            x + b.to_global(sbp=S(1))
        except gt.GlobalTensorError as error:
            caught = "aten.add.Tensor" in str(error)
        gt.communication("implicit")
        return policy, caught, model.weight.grad.sbp, b.full_tensor().shape, one.item(), \
            "GlobalTensor(" in shown, isinstance(total, float), gt.communication.current()

    for out in run_ranks(body, 2, timeout=60):
        assert out == ("explicit", True, (B,), torch.Size([8, 6]), 2.0, True, True, "implicit")


def test_environment_setting_and_bad_names(monkeypatch):
    monkeypatch.setenv("GT_COMMUNICATION", "explicit")

    def body(rank):
        x = gt.ones(4, 6, placement=TP, sbp=S(0))
        try:
            x + gt.ones(4, 6, placement=TP, sbp=S(1))
        except gt.GlobalTensorError as error:
            return gt.communication.current(), "aten.add.Tensor" in str(error)

    assert run_ranks(body, 2, timeout=60) == [("explicit", True)] * 2
    monkeypatch.setenv("GT_COMMUNICATION", "sometimes")
    assert "GT_COMMUNICATION: expected a communication policy" in \
        run_ranks(lambda r: _error(gt.communication.current), 1, timeout=30)[0]
    with pytest.raises(gt.GlobalTensorError, match="implicit, warn, explicit; found 'loud'"):
        gt.communication("loud")


def _error(fn):
    try:
        fn()
    except gt.GlobalTensorError as error:
        return str(error)


def test_the_block_without_f_runs_its_backward_under_explicit():
    # the gradients of h are partial sums; they flow on as P (linear backward ops, deferred
    # reductions) to g's backward, which reduces them once: Megatron's f is not needed
    ref_p = {n: t.requires_grad_(True) for n, t in weights().items()}
    block(X, ref_p, False).sum().backward()

    def body(rank):
        p, x = _globals()
        with gt.comm_trace() as t, gt.communication("explicit"):
            block(x, p, True, f=False).sum().backward()
        return {n: w.grad.full_tensor() for n, w in p.items()}, t.counts()

    for grads, counts in run_ranks(body, 2, timeout=120):
        for n, g in grads.items():
            torch.testing.assert_close(g, ref_p[n].grad, rtol=1e-4, atol=1e-5)
        assert counts["all_reduce"] == 3  # 2 g's forward + 1 backward, no f


def test_a_move_inside_backward_names_the_autograd_node_and_the_forward_line():
    def body(rank):
        p, x = _globals()
        y = block(x, p, False)                              # forward: implicit moves
        with gt.communication("explicit"):
            try:
                y.sum().backward()                          # a weight's gradient needs a move
            except gt.GlobalTensorError as error:
                return str(error)

    torch.autograd.set_detect_anomaly(True, check_nan=False)  # records forward lines
    try:
        messages = run_ranks(body, 2, timeout=60)
    finally:
        torch.autograd.set_detect_anomaly(False)
    text = messages[0]
    assert messages[0] == messages[1]
    assert "(`y.sum().backward()" in text and "in backward, autograd node " in text
    assert "from the forward at File" in text and "test_communication_policy.py" in text
    assert "grad_sbp" in text  # the fix: give the forward's move a grad_sbp
