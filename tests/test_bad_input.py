"""Bad input sweep: every public entry point rejects bad arguments quickly, clearly, and alike
on every rank; awkward but valid input (non-contiguous, zero-size, requires_grad) works."""
import datetime
import pickle

import numpy as np
import pytest
import torch

import globaltensor as gt
from globaltensor.errors import GlobalTensorError, PlacementError, SbpError, ShapeMismatchError
from globaltensor.testing import run_ranks

S, B, P = gt.sbp.split, gt.sbp.broadcast, gt.sbp.partial_sum


def _p1():
    return gt.placement("cpu", [0])


# (id, call, error class, words the message must hold). Every call is cheap and local: it fails
# before any communication, so in a world of several ranks every rank fails alike, at once.
CASES = [
    # placements
    ("placement type unknown", lambda: gt.placement("gpu", [0]), PlacementError, "found 'gpu'"),
    ("placement type not str", lambda: gt.placement(0, [0]), PlacementError, "device type"),
    ("placement no ranks", lambda: gt.placement("cpu"), PlacementError, "expected ranks"),
    ("placement empty list", lambda: gt.placement("cpu", []), PlacementError, "non-empty"),
    ("placement empty row", lambda: gt.placement("cpu", [[]]), PlacementError, "non-empty"),
    ("placement empty array", lambda: gt.placement("cpu", np.array([], dtype=np.int64)),
     PlacementError, "at least one rank"),
    ("placement ragged", lambda: gt.placement("cpu", [[0, 1], [2]]), PlacementError, "ragged"),
    ("placement float rank", lambda: gt.placement("cpu", [0.0]), PlacementError, "integer ranks"),
    ("placement str rank", lambda: gt.placement("cpu", ["0"]), PlacementError, "integer ranks"),
    ("placement bool rank", lambda: gt.placement("cpu", [True]), PlacementError, "integer ranks"),
    ("placement float array", lambda: gt.placement("cpu", np.array([0.0, 1.0])), PlacementError,
     "integer ranks"),
    ("placement set", lambda: gt.placement("cpu", {0, 1}), PlacementError, "integer ranks"),
    ("placement negative", lambda: gt.placement("cpu", [0, -1]), PlacementError, "ranks >= 0"),
    ("placement duplicate", lambda: gt.placement("cpu", [0, 0]), PlacementError, "distinct ranks"),
    ("placement.all unknown type", lambda: gt.placement.all("tpu"), PlacementError, "'tpu'"),
    ("placement axis out of range", lambda: _p1().groups_along(1), PlacementError,
     "placement axis in [0, 1), found 1"),
    # sbp
    ("split float dim", lambda: S(1.0), SbpError, "int dim, found 1.0"),
    ("split bool dim", lambda: S(True), SbpError, "int dim, found True"),
    ("sbp string", lambda: gt.zeros(2, placement=_p1(), sbp="S(0)"), SbpError, "found 'S(0)'"),
    ("sbp None entry", lambda: gt.zeros(2, placement=_p1(), sbp=(None,)), SbpError, "found None"),
    ("sbp empty", lambda: gt.zeros(2, placement=_p1(), sbp=()), SbpError, "at least one sbp"),
    ("sbp split uncalled", lambda: gt.zeros(2, placement=_p1(), sbp=S), SbpError,
     "split(0), not gt.sbp.split"),
    ("sbp too many", lambda: gt.zeros(2, placement=_p1(), sbp=(B, B)), SbpError,
     "expected 1 sbp values, one per placement axis, found 2"),
    ("split dim out of range", lambda: gt.zeros(2, placement=_p1(), sbp=S(1)), SbpError,
     "split(1) needs a tensor dim in [-1, 1)"),
    ("split of a 0-dim tensor", lambda: gt.tensor(3.0, placement=_p1(), sbp=S(0)), SbpError,
     "split(0) needs a tensor dim in [0, 0)"),
    # layouts
    ("layout negative shape", lambda: gt.Layout(_p1(), (B,), (-1, 2)), GlobalTensorError,
     "shape of ints >= 0, found (-1, 2)"),
    ("layout float shape", lambda: gt.Layout(_p1(), (B,), (1.5,)), GlobalTensorError,
     "shape of ints >= 0"),
    ("layout shape not a sequence", lambda: gt.Layout(_p1(), (B,), 5), GlobalTensorError,
     "found 5"),
    ("layout placement a list", lambda: gt.Layout([0], (B,), (2,)), PlacementError,
     "found [0] (list)"),
    # factories
    ("factory no placement", lambda: gt.zeros(2, sbp=B), GlobalTensorError, "need placement="),
    ("factory placement a list", lambda: gt.zeros(2, placement=[0], sbp=B), GlobalTensorError,
     "expected placement=gt.placement(type, ranks), found [0] (list)"),
    ("factory ranks beyond world", lambda: gt.zeros(2, placement=gt.placement("cpu", [0, 7]),
                                                    sbp=B), PlacementError, "found [7]"),
    ("factory negative size", lambda: gt.zeros(-1, placement=_p1(), sbp=B), GlobalTensorError,
     "non-negative ints, found [-1]"),
    ("factory float size", lambda: gt.ones(2.0, placement=_p1(), sbp=B), GlobalTensorError,
     "non-negative ints, found [2.0]"),
    ("factory dtype string", lambda: gt.zeros(2, placement=_p1(), sbp=B, dtype="float32"),
     GlobalTensorError, "torch.dtype (e.g. torch.float32) or None, found 'float32'"),
    ("random dtype string", lambda: gt.randn(2, placement=_p1(), sbp=B, dtype="float32"),
     GlobalTensorError, "found 'float32'"),
    ("requires_grad on ints", lambda: gt.zeros(2, placement=_p1(), sbp=B, dtype=torch.int64,
                                               requires_grad=True),
     GlobalTensorError, "floating point or complex dtype, found torch.int64"),
    ("full size an int", lambda: gt.full(3, 1.0, placement=_p1(), sbp=B), GlobalTensorError,
     "size as a tuple or list of ints, found 3"),
    ("full value a string", lambda: gt.full((3,), "a", placement=_p1(), sbp=B),
     GlobalTensorError, "fill_value to be a number, found 'a'"),
    ("arange zero step", lambda: gt.arange(0, 3, 0, placement=_p1(), sbp=B), GlobalTensorError,
     "non-zero step"),
    ("arange string end", lambda: gt.arange("3", placement=_p1(), sbp=B), GlobalTensorError,
     "arange's end to be a number, found '3'"),
    ("randint empty range", lambda: gt.randint(3, 3, (2,), placement=_p1(), sbp=B),
     GlobalTensorError, "low < high"),
    ("randint size an int", lambda: gt.randint(0, 3, 2, placement=_p1(), sbp=B),
     GlobalTensorError, "size as a tuple or list of ints, found 2"),
    ("tensor ragged data", lambda: gt.tensor([[1, 2], [3]], placement=_p1(), sbp=B),
     GlobalTensorError, "rectangular nested list"),
    ("cuda placement without cuda", lambda: gt.zeros(2, placement=gt.placement("cuda", [0]),
                                                     sbp=B),
     GlobalTensorError, "needs CUDA, found none"),
    # local -> global
    ("to_global without sbp", lambda: torch.ones(2).to_global(placement=_p1()), GlobalTensorError,
     "needs both placement and sbp"),
    ("to_global placement a list", lambda: torch.ones(2).to_global(placement=[0], sbp=B),
     GlobalTensorError, "found [0] (list)"),
    ("to_global split of 0-dim", lambda: torch.tensor(1.0).to_global(placement=_p1(), sbp=S(0)),
     SbpError, "split(0) needs a tensor dim in [0, 0)"),
    ("to_global split dim beyond", lambda: torch.ones(2).to_global(placement=_p1(), sbp=S(2)),
     SbpError, "split(2) needs a tensor dim in [-1, 1)"),
    ("to_global bad grad_sbp", lambda: torch.ones(2).to_global(placement=_p1(), sbp=B,
                                                               grad_sbp="x"),
     SbpError, "found 'x'"),
    ("to_global ranks beyond world", lambda: torch.ones(2).to_global(
        placement=gt.placement("cpu", [9]), sbp=B), PlacementError, "found [9]"),
    # global -> global
    ("redistribute placement a list", lambda: _g().to_global(placement=[0]), GlobalTensorError,
     "found [0] (list)"),
    ("redistribute split dim beyond", lambda: _g().to_global(sbp=S(3)), SbpError,
     "split(3) needs a tensor dim"),
    ("redistribute sbp too many", lambda: _g().to_global(sbp=(B, B)), SbpError,
     "expected 1 sbp values"),
    ("redistribute 1-D to 2-D without sbp", lambda: _g().to_global(
        placement=gt.placement("cpu", [[0]])), GlobalTensorError, "needs an sbp for each of its 2"),
    ("redistribute to another device type", lambda: _g().to_global(
        placement=gt.placement("cuda", [0])), GlobalTensorError, "between device types"),
    ("redistribute bad grad_sbp", lambda: _g().to_global(sbp=S(0), grad_sbp=5), SbpError,
     "found 5 (int)"),
    ("item of many elements", lambda: _g().item(), GlobalTensorError, "one element, found shape"),
    ("pickle a global tensor", lambda: pickle.dumps(_g()), GlobalTensorError, "cannot be pickled"),
    # misc public entry points
    ("explain a local tensor", lambda: gt.explain(torch.ones(2), sbp=B), GlobalTensorError,
     "expects a global tensor, found Tensor"),
    ("explain bad sbp", lambda: gt.explain(_g(), sbp="B"), SbpError, "found 'B'"),
    ("visualize a local tensor", lambda: gt.visualize(torch.ones(2)), GlobalTensorError,
     "global tensor or a Layout, found Tensor"),
    ("manual_seed a string", lambda: gt.manual_seed("a"), GlobalTensorError, "found 'a'"),
    ("set_debug not a bool", lambda: gt.set_debug("yes"), GlobalTensorError, "found 'yes'"),
    ("init timeout a string", lambda: gt.init(timeout="5"), GlobalTensorError,
     "seconds > 0 or a datetime.timedelta, found '5'"),
    ("init timeout negative", lambda: gt.init(timeout=datetime.timedelta(seconds=-1)),
     GlobalTensorError, "seconds > 0"),
]


def _g():
    """A small global tensor on every rank of the world (world of 1: rank 0)."""
    return gt.ones(2, placement=gt.placement.all("cpu"), sbp=B)


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_bad_input_in_a_world_of_one(case, monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    _, call, kind, words = case
    with pytest.raises(kind) as info:
        call()
    assert words in str(info.value)


def _uninitialised_only(case) -> bool:
    return case[0].startswith("init ")  # gt.init inside an initialised world is a no-op


def test_every_rank_fails_alike_and_at_once():
    """The same sweep on 3 thread-ranks: every rank raises the same error, nobody waits."""
    cases = [c for c in CASES if not _uninitialised_only(c)]

    def body(rank):
        out = []
        for name, call, kind, words in cases:
            try:
                call()
                out.append((name, "no error"))
            except GlobalTensorError as e:
                out.append((name, type(e).__name__, str(e)))
        return out

    results = run_ranks(body, 3, timeout=30)
    for r in (1, 2):
        for mine, first in zip(results[r], results[0]):
            assert mine == first
    for (name, _, kind, words), got in zip(cases, results[0]):
        assert got[1] == kind.__name__ or issubclass(getattr(gt.errors, got[1], object), kind), got
        assert words.replace("[0, 7]", "") in got[2], got


# --- disagreements between ranks: each rank's piece is fine alone ----------------------------------


def _messages(body, n):
    def wrapped(rank):
        try:
            body(rank)
        except GlobalTensorError as e:
            return type(e).__name__, str(e)
        return None

    return run_ranks(wrapped, n, timeout=30)


def test_pieces_breaking_the_uneven_rule_are_named_on_every_rank():
    p = gt.placement("cpu", [0, 1, 2])
    out = _messages(lambda r: torch.ones([3, 1, 2][r], 4).to_global(placement=p, sbp=S(0)), 3)
    assert len(set(out)) == 1
    kind, msg = out[0]
    assert kind == "ShapeMismatchError"
    assert "rank 0 passed a piece of shape [3, 4], expected [2, 4] for a global shape [6, 4]" in msg
    assert "found: {0: [3, 4], 1: [1, 4], 2: [2, 4]}" in msg


def test_pieces_of_different_dtypes_are_named_on_every_rank():
    p = gt.placement("cpu", [0, 1])
    dtypes = [torch.float32, torch.int64]
    out = _messages(lambda r: torch.ones(2, dtype=dtypes[r]).to_global(placement=p, sbp=S(0)), 2)
    assert len(set(out)) == 1
    assert out[0][0] == "ShapeMismatchError"
    assert "found torch.float32 on rank 0 and torch.int64 on rank 1" in out[0][1]


def test_pieces_of_different_ndim_are_named_on_every_rank():
    p = gt.placement("cpu", [0, 1])
    out = _messages(lambda r: torch.ones([2] * (r + 1)).to_global(placement=p, sbp=B), 2)
    assert len(set(out)) == 1
    assert "rank 1 with [2, 2]" in out[0][1]


def test_operators_reject_mixed_placements_and_local_operands():
    def body(rank):
        p, q = gt.placement("cpu", [0, 1]), gt.placement("cpu", [1, 0])
        x = gt.ones(4, 2, placement=p, sbp=S(0))
        errors = []
        for call in (lambda: x + gt.ones(4, 2, placement=q, sbp=S(0)),
                     lambda: x + torch.ones(4, 2)):
            with pytest.raises(GlobalTensorError) as info:
                call()
            errors.append(str(info.value))
        scalar = (x + torch.tensor(2.0)).full_tensor()  # a 0-dim local is a scalar: fine
        return errors, scalar.tolist()

    out = run_ranks(body, 2, timeout=30)
    assert out[0] == out[1]
    (mixed, local), scalar = out[0]
    assert "expected global tensors of one placement, found 2" in mixed
    assert "a local tensor of shape [4, 2]" in local
    assert scalar == [[3.0, 3.0]] * 4


# --- awkward but valid input -------------------------------------------------------------------------


def test_non_contiguous_local_pieces_are_taken_by_value():
    def body(rank):
        p = gt.placement("cpu", [0, 1])
        base = torch.arange(12.0).reshape(3, 4) + 100 * rank
        piece = base.t()[:, ::2]  # (4, 2) non-contiguous view
        assert not piece.is_contiguous()
        x = piece.to_global(placement=p, sbp=S(1))
        y = piece.to_global(placement=p, sbp=B)
        return x.full_tensor(), y.full_tensor()

    (x0, y0), (x1, y1) = run_ranks(body, 2, timeout=30)
    expect_piece = lambda r: (torch.arange(12.0).reshape(3, 4) + 100 * r).t()[:, ::2]
    torch.testing.assert_close(x0, torch.cat([expect_piece(0), expect_piece(1)], dim=1))
    torch.testing.assert_close(y0, expect_piece(0))  # rank 0's data wins for B
    torch.testing.assert_close(x1, x0)
    torch.testing.assert_close(y1, y0)


def test_zero_size_tensors_round_trip():
    def body(rank):
        p = gt.placement("cpu", [0, 1, 2])
        empty_rows = torch.ones(0, 5).to_global(placement=p, sbp=S(0))
        fewer_rows = gt.arange(2, placement=p, sbp=S(0))  # N < k: rank 2 holds an empty piece
        moved = fewer_rows.to_global(sbp=B)
        back = gt.zeros(0, 3, placement=p, sbp=S(1)).to_global(sbp=S(0))
        return (list(empty_rows.shape), list(fewer_rows.to_local().shape), moved.to_local().tolist(),
                list(back.shape), list(back.to_local().shape))

    out = run_ranks(body, 3, timeout=30)
    assert out[0] == ([0, 5], [1], [0, 1], [0, 3], [0, 3])
    assert out[2] == ([0, 5], [0], [0, 1], [0, 3], [0, 3])


def test_requires_grad_is_preserved_and_gradients_flow():
    def body(rank):
        p = gt.placement("cpu", [0, 1])
        leaf = torch.full((2, 3), float(rank + 1), requires_grad=True)
        x = leaf.to_global(placement=p, sbp=S(0))
        y = x.to_global(sbp=B)
        w = gt.ones(4, 3, placement=p, sbp=S(0), requires_grad=True)
        flags = (x.requires_grad, y.requires_grad, y.to_local().requires_grad, w.requires_grad,
                 w.is_leaf)
        (y.to_local() * 2).sum().backward()
        return flags, leaf.grad.tolist()

    out = run_ranks(body, 2, timeout=30)
    for flags, grad in out:
        assert flags == (True, True, True, True, True)
        # y is B: each rank's local 2*sum contributes 2 to every element; S(0) grad sums them
        assert grad == [[4.0] * 3] * 2


def test_world_of_one_needs_no_init(monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    p = _p1()
    x = torch.arange(4.0).to_global(placement=p, sbp=B)
    y = torch.arange(4.0).to_global(placement=p, sbp=S(0))
    assert x.to_local().tolist() == y.to_global(sbp=B).to_local().tolist() == [0, 1, 2, 3]


def test_forgotten_init_in_a_bigger_job_is_explained(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(GlobalTensorError, match=r"expected gt.init\(\) before global operations "
                                                r"in a job of 2 ranks"):
        torch.ones(2).to_global(placement=gt.placement("cpu", [0, 1]), sbp=S(0))


def test_shape_mismatch_error_is_a_global_tensor_error():
    assert issubclass(ShapeMismatchError, GlobalTensorError)
    assert issubclass(GlobalTensorError, ValueError) and issubclass(GlobalTensorError, RuntimeError)
