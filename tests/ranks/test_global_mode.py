"""Single-device code on global tensors (issue 12): global mode, local tensors and Python data
meeting global tensors, ops whose output shape depends on the data, 0-dim local indices,
casts, module conversion back and forth. Each against torch on the full tensors, on
thread-ranks, with a placement that holds every rank and one that leaves a rank out."""
import numpy as np
import pytest
import torch
import torch.nn.functional as F

import globaltensor as gt
from globaltensor.testing import RankFailed, run_ranks

S, B, P = gt.sbp.split, gt.sbp.broadcast, gt.sbp.partial_sum
X = torch.tensor([[1., -2, 0, 4], [0, 5, -6, 0], [7, 0, 9, -1]])
ALL = gt.placement("cpu", [0, 1])
# a 3-rank world where rank 2 is outside the placement: it still learns shapes and values
PART = gt.placement("cpu", [0, 1])
MASK = torch.ones(3, 3, dtype=torch.bool).tril()


def on_ranks(fn, sbps=(B, S(0), S(1)), world=2, placement=ALL):
    """``fn(x)`` for x = X laid out with each sbp; returns per rank the list of full results
    (plain values as they are)."""
    def body(rank):
        out = []
        for sbp in sbps:
            x = gt.tensor(X, placement=placement, sbp=sbp)
            r = fn(x)
            out.append(_full(r))
        return out
    return run_ranks(body, world, timeout=60)


def _full(r):
    if isinstance(r, gt.GlobalTensor):
        return ("global", r.full_tensor())
    if isinstance(r, (tuple, list)):
        return type(r)(_full(v) for v in r)
    if isinstance(r, torch.Tensor):
        return ("local", r)
    return r


def _same(got, want):
    if isinstance(want, torch.Tensor):
        assert isinstance(got, tuple) and got[0] == "global", f"expected a global tensor, found {got!r}"
        torch.testing.assert_close(got[1], want)
    elif isinstance(want, (tuple, list)):
        assert len(got) == len(want)
        for g, w in zip(got, want):
            _same(g, w)
    else:
        assert got == want


DATA_DEPENDENT = {
    "nonzero": lambda x: torch.nonzero(x),
    "where(cond)": lambda x: torch.where(x > 0),
    "masked_select": lambda x: torch.masked_select(x, x > 0),
    "x[mask]": lambda x: x[x > 0],
    "unique": lambda x: torch.unique(x, return_counts=True),
    "bincount": lambda x: torch.bincount(x.abs().long().flatten()),
    "repeat_interleave": lambda x: torch.repeat_interleave(x.abs().long().flatten()[:4]),
    "equal": lambda x: torch.equal(x, x * 1),
    "not equal": lambda x: torch.equal(x, x + 1),
    "allclose": lambda x: torch.allclose(x, x + 1e-9),
    "histc": lambda x: torch.histc(x, bins=4),
}


@pytest.mark.parametrize("name", sorted(DATA_DEPENDENT))
@pytest.mark.parametrize("world", [2, 3])
def test_ops_whose_output_shape_depends_on_the_data(name, world):
    fn = DATA_DEPENDENT[name]
    want = fn(X)
    for results in on_ranks(fn, world=world, placement=ALL if world == 2 else PART):
        for got in results:
            if world == 3 and isinstance(want, torch.Tensor):
                assert got[0] == "global"  # the outside rank learnt the shape and got the value
            _same(got, want)


LOCAL_DATA = {
    "x[[1, 2]]": (lambda x: x[[1, 2]], lambda x: x[[1, 2]]),
    "x[[True, False, True]]": (lambda x: x[[True, False, True]], lambda x: x[[True, False, True]]),
    "x[:, np.array([0, 3])]": (lambda x: x[:, np.array([0, 3])], lambda x: x[:, np.array([0, 3])]),
    "x.new_tensor": (lambda x: x.new_tensor([1, 2]), lambda x: x.new_tensor([1, 2])),
    "x.new(sizes).zero_()": (lambda x: x.new(2, 3).zero_(), lambda x: x.new(2, 3).zero_()),
    "x + np.array": (lambda x: x + np.arange(4, dtype=np.float32),
                     lambda x: x + torch.arange(4.0)),
    "np.array * x": (lambda x: np.arange(4, dtype=np.float32) * x,
                     lambda x: torch.arange(4.0) * x),
    "index_select, 0-dim index": (lambda x: torch.index_select(x, 0, torch.tensor(1)),) * 2,
    "index_add, 0-dim index": (lambda x: x.index_add(0, torch.tensor(2), x[:1] * 2),) * 2,
    "embedding, 0-dim index": (lambda x: F.embedding(torch.tensor(1), x),) * 2,
    "nll_loss, 0-dim target": (lambda x: F.nll_loss(x[0], torch.tensor(1)),) * 2,
    "to(cpu, float64)": (lambda x: x.to("cpu", torch.float64),) * 2,
    "to(other)": (lambda x: x.to(x.double()),) * 2,
    "type_as": (lambda x: x.type_as(x.double()),) * 2,
    "softmax(dtype=)": (lambda x: torch.softmax(x, 0, dtype=torch.float64),) * 2,
    "prelu": (lambda x: F.prelu(x, x.new_tensor([0.25])), lambda x: F.prelu(x, torch.tensor([0.25]))),
    "sdpa with a bool mask": (
        lambda x: F.scaled_dot_product_attention(x[None], x[None], x[None],
                                                 attn_mask=x.new_tensor(MASK, dtype=torch.bool)),
        lambda x: F.scaled_dot_product_attention(x[None], x[None], x[None], attn_mask=MASK)),
}


@pytest.mark.parametrize("name", sorted(LOCAL_DATA))
def test_python_data_and_local_scalars_with_global_tensors(name):
    fn, ref = LOCAL_DATA[name]
    want = ref(X)
    for results in on_ranks(fn):
        for got in results:
            _same(got, want)


def test_set_item_with_a_list_index_and_a_numpy_value():
    want = X.clone()
    want[[0, 2], 1] = torch.tensor([10., 20.])
    for results in on_ranks(lambda x: _set(x, ([0, 2], 1), np.array([10., 20.], dtype=np.float32))):
        for got in results:
            _same(got, want)


def _set(x, index, value):
    x[index] = value
    return x


def test_backward_of_a_cast_to_double():
    def fn(x):
        x = x.detach().requires_grad_()
        (x.double() ** 2).sum().backward()
        return x.grad
    for results in on_ranks(fn):
        for got in results:
            _same(got, 2 * X)


# ----------------------------------------------------------------------------- global mode


def test_factories_in_global_mode_are_global_and_agree_with_torch():
    def fn(x):
        with gt.global_mode(x.placement):
            pos = torch.arange(4)
            mask = torch.full((3, 4), float("-inf")).triu(1)[:, :4]
            eye = torch.eye(3, 4)
            table = torch.tensor([[1.0, 2.0, 3.0, 4.0]])
            zeros = torch.zeros(3, 4)
            out = x + pos + mask.clamp(min=-1) + eye + table + zeros
            kinds = [type(t).__name__ for t in (pos, mask, eye, table, zeros)]
        outside = type(torch.zeros(2)).__name__
        return out, kinds, outside
    want = X + torch.arange(4) + torch.full((3, 4), float("-inf")).triu(1).clamp(min=-1) \
        + torch.eye(3, 4) + torch.tensor([[1.0, 2.0, 3.0, 4.0]])
    for results in on_ranks(fn):
        for out, kinds, outside in results:
            _same(out, want)
            assert kinds == ["GlobalTensor"] * 5 and outside == "Tensor"


def test_global_mode_with_a_split_sbp_lays_factories_out_so():
    def body(rank):
        with gt.global_mode(ALL, sbp=S(0)):
            t = torch.arange(6.0).reshape(3, 2)  # reshape of an S(0) arange
            r = torch.ones(5, 2)
        return t.full_tensor(), r.sbp, r.to_local().shape
    for t, sbp, local in run_ranks(body, 2, timeout=60):
        torch.testing.assert_close(t, torch.arange(6.0).reshape(3, 2))
        assert sbp == (S(0),) and local[0] in (2, 3)


def test_random_factories_in_global_mode_agree_on_every_rank():
    def body(rank):
        gt.manual_seed(7)
        with gt.global_mode(ALL):
            a, b, c = torch.randn(4, 3), torch.rand(5), torch.randperm(6)
        return a.to_local(), b.to_local(), c.to_local()
    first, second = run_ranks(body, 2, timeout=60)
    for u, v in zip(first, second):
        torch.testing.assert_close(u, v)  # B pieces: the whole value, the same on each rank
    assert sorted(first[2].tolist()) == list(range(6))


def test_local_tensors_meeting_global_ones_in_global_mode_are_broadcast():
    local = torch.tensor([1.0, 2.0, 3.0, 4.0])

    def body(rank):
        x = gt.tensor(X, placement=ALL, sbp=S(0))
        try:
            x + local
            outside = "no error"
        except gt.GlobalTensorError as e:
            outside = str(e)
        with gt.global_mode(ALL):
            inside = (x + local).full_tensor()
            composite = torch.quantile(x, torch.tensor([0.25, 0.5]), dim=1).full_tensor()
            power = torch.matrix_power(x[:, :3], 0).full_tensor()
        return outside, inside, composite, power
    for outside, inside, composite, power in run_ranks(body, 2, timeout=60):
        assert "a local tensor of shape [4]" in outside and "gt.global_mode" in outside
        torch.testing.assert_close(inside, X + local)
        torch.testing.assert_close(composite, torch.quantile(X, torch.tensor([0.25, 0.5]), dim=1))
        torch.testing.assert_close(power, torch.eye(3))


def test_gt_debug_names_ranks_whose_local_values_differ_in_global_mode():
    def body(rank):
        gt.set_debug(True)
        try:
            x = gt.tensor(X, placement=ALL, sbp=S(0))
            with gt.global_mode(ALL):
                x + torch.full((4,), float(rank))  # not the same on every rank
        finally:
            gt.set_debug(False)
    with pytest.raises(RankFailed, match="taken as broadcast") as info:
        run_ranks(body, 2, timeout=60)
    assert "value_digest" in str(info.value)


def test_lstm_without_an_initial_state_in_a_converted_module():
    torch.manual_seed(3)
    lstm = torch.nn.LSTM(4, 5, batch_first=True).double()
    inputs = torch.randn(3, 6, 4, dtype=torch.float64)
    want, _ = lstm(inputs)
    want.sum().backward()
    want_grad = lstm.weight_ih_l0.grad.clone()
    import copy
    base = copy.deepcopy(lstm)

    def body(rank):
        m = copy.deepcopy(base)
        m.zero_grad()
        m.to_global(ALL, B)
        out, _ = m(gt.tensor(inputs, placement=ALL, sbp=S(0)))
        out.sum().backward()
        return out.full_tensor(), m.weight_ih_l0.grad.full_tensor()
    for out, grad in run_ranks(body, 2, timeout=60):
        torch.testing.assert_close(out, want.detach())
        torch.testing.assert_close(grad, want_grad)


@pytest.mark.parametrize("pad, value", [((0, 1), -100.0), ((1, 1, 0, 2), 0.0), ((0, 0, 2, 0), 3.0)])
def test_constant_pad_keeps_unpadded_dims_split(pad, value):
    # HF's causal-LM loss shifts the labels with F.pad(labels, (0, 1), value=-100)
    from helpers import check, gen

    check(lambda x: F.pad(x, pad, value=value), [gen(5, 4, 3, seed=11)])


@pytest.mark.parametrize("training", [True, pytest.param(False, marks=pytest.mark.slow)])
def test_batch_norm_over_every_layout(training):
    # sync-BN semantics: the statistics of the whole batch whatever the split (a rule with a
    # kernel for batch and spatial splits in training, local for a channel split)
    from helpers import check, gen

    x, w, b = gen(5, 3, 4, seed=23) * 3 + 7, gen(3, seed=24), gen(3, seed=25)
    if training:  # batch statistics (running statistics: see the ResNet test)
        check(lambda x, w, b: F.batch_norm(x, None, None, w, b, training=True),
              [x, w, b], only=lambda sbps: P not in sbps[0])
    else:  # the running statistics as inputs, laid out like the weight
        mean, var = gen(3, seed=21), gen(3, seed=22).abs() + 0.5
        check(lambda x, w, b, m, v: F.batch_norm(x, m.detach(), v.detach(), w, b, training=False),
              [x, w, b, mean, var], only=lambda sbps: P not in sbps[0] + sbps[3] + sbps[4])
    check(lambda x: F.max_pool2d(x, 2), [gen(3, 2, 4, 4, seed=26)])
    check(lambda x: F.adaptive_avg_pool2d(x, (2, 1)), [gen(3, 2, 5, 4, seed=27)])


@pytest.mark.parametrize("bias_shape", [(6,), pytest.param((1, 6), marks=pytest.mark.slow),
                                        pytest.param((5, 6), marks=pytest.mark.slow), ()])
def test_addmm_over_every_layout(bias_shape):
    # nn.Linear with a bias and GPT-2's Conv1D run addmm: a rule of its own (the bias added once
    # where the product is a partial sum), no decomposition
    from helpers import check, gen

    check(lambda b, x, w: torch.addmm(b, x, w, beta=0.5, alpha=2.0),
          [gen(*bias_shape, seed=31), gen(5, 4, seed=32), gen(4, 6, seed=33)])


class Sampler(torch.nn.Module):
    """A module with a public method besides forward that builds local tensors (as HF's
    ``generate`` builds its default mask and cache positions)."""

    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.arange(12.0).reshape(3, 4))

    def forward(self, x):
        return x @ self.w + torch.ones(4)

    def sample(self, x, steps: int):
        for _ in range(steps):
            x = self(x) / 100 + torch.arange(4.0)
        return x


def test_every_public_method_of_a_converted_module_runs_in_global_mode():
    x = torch.ones(2, 3)
    want = Sampler().sample(x, 1)

    def body(rank):
        import copy

        m = Sampler().to_global(ALL, lambda name, t: S(1))
        twin = copy.deepcopy(m)  # keeps running its own methods in global mode
        got = [m.sample(gt.tensor(x, placement=ALL, sbp=S(0)), 1).full_tensor(),
               twin.sample(gt.tensor(x, placement=ALL, sbp=B), 1).full_tensor()]
        name = type(m).__name__
        m.to_local(full=True)  # a plain module again: its methods are the user's own
        plain = m.sample(torch.ones(2, 3), 1)
        return got, name, type(m) is Sampler, plain

    for got, name, plain_class, plain in run_ranks(body, 2, timeout=60):
        assert name == "Sampler" and plain_class
        for g in got:
            torch.testing.assert_close(g, want)
        torch.testing.assert_close(plain, want)


@pytest.mark.parametrize("grad_mode", ["inference_mode", "no_grad"])
def test_global_ops_under_inference_mode_and_no_grad(grad_mode):
    """Two global tensors made in inference mode with different splits, added (the moved-piece
    memo keyed on a version counter inference tensors lack), then more ops and moves."""
    a_full, b_full = torch.arange(16.0).reshape(4, 4), torch.ones(4, 4)

    def body(rank):
        with getattr(torch, grad_mode)():
            a = gt.tensor(a_full, placement=ALL, sbp=S(0))
            b = gt.tensor(b_full, placement=ALL, sbp=S(1))
            c = a + b
            c.add_(1)  # a write the memo must see: the next move reads the new value
            d = (c @ b).to_global(sbp=B) + c.sum()
            return c.full_tensor(), d.full_tensor(), F.softmax(c, -1).full_tensor()

    c = a_full + b_full + 1
    for got in run_ranks(body, 2, timeout=60):
        torch.testing.assert_close(got[0], c)
        torch.testing.assert_close(got[1], c @ b_full + c.sum())
        torch.testing.assert_close(got[2], F.softmax(c, -1))
