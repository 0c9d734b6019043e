"""Random ops that take tensor inputs (``multinomial``, ``bernoulli(p)``, ``normal(mean, std)``,
``poisson``, ``exponential``, ``cauchy_``...): drawn from gt's counter-based stream, so a given
``gt.manual_seed`` gives the same global value whatever the layout (one process included) and
broadcast replicas draw alike; and the draws follow their law."""
import pytest
import torch

import globaltensor as gt
from globaltensor.layout import Layout
from globaltensor.testing import run_ranks

from helpers import G2, G22, make_global

S, B = gt.sbp.split, gt.sbp.broadcast
G1 = gt.placement("cpu", [0])
PROBS = torch.rand(5, 6, dtype=torch.float64, generator=torch.Generator().manual_seed(4)) + 0.05

OPS = {
    "multinomial": lambda x: torch.multinomial(x, 3),
    "multinomial_replacement": lambda x: torch.multinomial(x, 7, replacement=True),
    "bernoulli": lambda x: torch.bernoulli(x / 2),
    "bernoulli_tensor_p": lambda x: torch.ops.aten.bernoulli.Tensor(x, x / 2),
    "normal_mean_std": lambda x: torch.normal(x, x),
    "normal_mean": lambda x: torch.normal(x, 2.0),
    "normal_std": lambda x: torch.normal(2.0, x),
    "normal_broadcast_std": lambda x: torch.normal(x, x[:1]),  # std (1, 6): a row for all
    "bernoulli_broadcast_p": lambda x: torch.ops.aten.bernoulli.Tensor(x, x[:, :1] / 2),
    "poisson": lambda x: torch.poisson(x * 3),
    "rand_like": torch.rand_like,
    "exponential": lambda x: torch.ops.aten.exponential(x, 2.0),
    "cauchy_": lambda x: x.clone().cauchy_(),
    "geometric_": lambda x: x.clone().geometric_(0.3),
    "log_normal_": lambda x: x.clone().log_normal_(),
}
LAYOUTS = [(G1, (B,), 1), (G2, (S(0),), 2), (G2, (S(1),), 2), (G22, (S(0), S(1)), 4),
           (G22, (B, S(0)), 4)]


def _draws(grid, sbp, world):
    def body(rank):
        out = {}
        for name, fn in OPS.items():
            gt.manual_seed(3)
            x = make_global(PROBS, Layout(grid, sbp, PROBS.shape), rank)
            y = fn(x)
            out[name] = (y.full_tensor(), y.to_global(sbp=(B,) * grid.ndim).to_local())
        return out
    return run_ranks(body, world, timeout=120)


def test_tensor_input_draws_are_the_same_global_value_for_any_layout():
    want = _draws(G1, (B,), 1)[0]
    for grid, sbp, world in LAYOUTS[1:]:
        got = _draws(grid, sbp, world)
        for name in OPS:
            for rank in range(world):
                assert torch.equal(got[rank][name][0], want[name][0]), (name, sbp, rank)
    assert want["multinomial"][0].shape == (5, 3)
    assert all(len(set(row.tolist())) == 3 for row in want["multinomial"][0])  # no repeats
    assert want["multinomial_replacement"][0].shape == (5, 7)


def test_replicas_draw_alike():
    def body(rank):
        gt.manual_seed(9)
        x = make_global(PROBS, Layout(G22, (B, S(0)), PROBS.shape), rank)
        return torch.multinomial(x, 2).to_local(), torch.normal(x, 1.0).to_local()

    out = run_ranks(body, 4, timeout=60)
    for a, b in ((0, 2), (1, 3)):  # ranks 0 and 2 hold the same rows (axis 0 is broadcast)
        assert torch.equal(out[a][0], out[b][0]) and torch.equal(out[a][1], out[b][1])


def _one_process(fn, full, seed=0):
    def body(rank):
        gt.manual_seed(seed)
        return fn(gt.tensor(full, placement=G1, sbp=B)).full_tensor()
    return run_ranks(body, 1, timeout=60)[0]


def test_multinomial_follows_the_probabilities():
    probs = torch.tensor([[0.1, 0.0, 0.2, 0.7]], dtype=torch.float64).repeat(4000, 1)
    one = _one_process(lambda x: torch.multinomial(x, 1).flatten(), probs)
    freq = torch.bincount(one, minlength=4).double() / 4000
    torch.testing.assert_close(freq, probs[0], atol=0.03, rtol=0)
    many = _one_process(lambda x: torch.multinomial(x[:1], 4000, replacement=True), probs)
    freq = torch.bincount(many.flatten(), minlength=4).double() / 4000
    torch.testing.assert_close(freq, probs[0], atol=0.03, rtol=0)
    assert freq[1] == 0
    # without replacement: the first draw takes 3 of [0.1, 0.2, 0.7] (all that have mass)
    three = _one_process(lambda x: torch.multinomial(x[:50], 3), probs)
    assert all(sorted(r.tolist()) == [0, 2, 3] for r in three)
    four = _one_process(lambda x: torch.multinomial(x[:50], 4), probs)  # as torch: the
    assert all(r[3] == 1 for r in four)  # category without mass drawn last


def test_poisson_and_normal_follow_their_parameters():
    rates = torch.tensor([0.0, 0.5, 4.0, 300.0], dtype=torch.float64).repeat(3000, 1)
    draws = _one_process(torch.poisson, rates)
    assert torch.equal(draws[:, 0], torch.zeros(3000, dtype=torch.float64))
    torch.testing.assert_close(draws.mean(0)[1:], rates[0, 1:], rtol=0.05, atol=0)
    torch.testing.assert_close(draws.var(0)[1:], rates[0, 1:], rtol=0.12, atol=0)
    mean = torch.tensor([-3.0, 0.0, 10.0], dtype=torch.float64).repeat(3000, 1)
    z = _one_process(lambda m: torch.normal(m, 2.0), mean)
    torch.testing.assert_close(z.mean(0), mean[0], atol=0.15, rtol=0)
    torch.testing.assert_close(z.std(0), torch.full((3,), 2.0, dtype=torch.float64), atol=0.1, rtol=0)


@pytest.mark.parametrize("probs,message", [
    ([[0.5, -0.1]], "element < 0"), ([[0.0, 0.0]], "sum of probabilities"),
])
def test_multinomial_refuses_bad_probabilities_as_torch_does(probs, message):
    with pytest.raises(RuntimeError, match=message):
        torch.multinomial(torch.tensor(probs), 2)

    def body(rank):
        x = gt.tensor(torch.tensor(probs), placement=G2, sbp=B)
        with pytest.raises(Exception, match=message):
            torch.multinomial(x, 2)
    run_ranks(body, 2, timeout=60)
