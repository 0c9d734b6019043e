"""gt.verify on thread-ranks: every global op (forward, backward, explicit to_global) computed
again on the full tensors; a planted wrong rule and a rank-dependent local tensor are named with
the op and the user's line, on every rank; a correct HF Llama TP x DP step passes."""
import copy

import pytest
import torch

import globaltensor as gt
from globaltensor.ops import register, table
from globaltensor.testing import run_ranks

S, B, P = gt.sbp.split, gt.sbp.broadcast, gt.sbp.partial_sum
P2 = gt.placement("cpu", [0, 1])


@torch.library.custom_op("gt_verify::planted_cube", mutates_args=())
def cube(x: torch.Tensor) -> torch.Tensor:
    return x * x * x


@cube.register_fake
def _(x):
    return torch.empty_like(x)


# the planted bug, through the public registration API (a custom op is named with its
# namespace, as torch names it): "P -> P" claims cube is linear
register("gt_verify::planted_cube.default", rule=lambda call: table("B -> B", "S(0) -> S(0)", "P -> P"))


def _errors(body, world=2):
    return run_ranks(body, world, timeout=120)


def test_report_records_forward_backward_and_to_global():
    def body(rank):
        torch.manual_seed(0)
        x = torch.randn(4, 3).to_global(P2, S(0))
        w = torch.randn(3, 5).to_global(P2, B).requires_grad_(True)
        with gt.verify(mode="report", show=False) as v:
            y = (x @ w).relu()
            loss = y.to_global(sbp=B).sum()
            loss.backward()
        count = len(v.records)
        _ = x * 2  # after the block: not verified
        return [(r.op, r.diff.ok) for r in v.records], count == len(v.records), v.table(), \
            [r.diff.floor for r in v.records if r.op == "aten.mm.default"]

    for ops, unchanged, text, floors in _errors(body):
        names = [op for op, _ in ops]
        assert all(ok for _, ok in ops) and unchanged
        assert names.count("aten.mm.default") == 2  # forward, and w's gradient in backward
        assert {"aten.relu.default", "to_global", "backward of to_global",
                "aten.threshold_backward.default"} <= set(names)
        assert text.splitlines()[0] == f"gt.verify: {len(ops)} ops checked, 0 differ beyond the tolerance"
        assert all(f is not None and 0 <= f < 1e-5 for f in floors)


def test_planted_wrong_rule_is_named_with_its_line_on_every_rank():
    def body(rank):
        torch.manual_seed(0)
        x = torch.randn(4, 6).to_global(P2, S(1))
        w = torch.randn(6, 3).to_global(P2, S(0))
        with gt.verify():
            h = x @ w                       # a partial sum: (P,)
            try:
                y = cube(h)                 # the wrong rule keeps P: sum of cubes != cube of sum
            except gt.GlobalTensorError as error:
                return str(error)
            return y

    messages = _errors(body)
    assert messages[0] == messages[1]
    text = messages[0]
    assert "gt.verify: gt_verify.planted_cube.default at " in text
    assert "test_verify.py:" in text and "(`y = cube(h)" in text
    assert "layouts: (P,)[4, 3] -> (P,)[4, 3]" in text
    assert "beyond rounding" in text and "max abs error" in text and "rounding floor" in text


def test_report_puts_the_planted_bug_first():
    def body(rank):
        torch.manual_seed(0)
        x = torch.randn(4, 6).to_global(P2, S(1))
        w = torch.randn(6, 3).to_global(P2, S(0))
        with gt.verify(mode="report", show=False) as v:
            cube(x @ w).sum()
        return [(r.op, r.diff.ok, r.diff.max_abs, r.diff.floor) for r in v.records], v.table()

    records, text = _errors(body)[0]
    bad = [r for r in records if not r[1]]
    assert [r[0] for r in bad] == ["gt_verify.planted_cube.default"]
    assert bad[0][2] > 1e-2 and bad[0][3] is not None and bad[0][3] < 1e-5
    assert text.splitlines()[2].lstrip().startswith("DIFFERS  gt_verify.planted_cube.default")


def test_a_local_tensor_that_differs_per_rank_in_global_mode_is_named():
    def body(rank):
        torch.manual_seed(rank)             # the user's bug: a different seed on each rank
        noise = torch.randn(6)
        x = gt.ones(4, 6, placement=P2, sbp=S(0))
        with gt.global_mode(P2), gt.verify():
            try:
                y = x + noise               # the local tensor is taken as broadcast
            except gt.GlobalTensorError as error:
                return str(error)
            return y

    messages = _errors(body)
    assert messages[0] == messages[1]
    assert "aten.add.Tensor at " in messages[0] and "(`y = x + noise" in messages[0]
    assert "rank 1 holds another value than rank 0" in messages[0]


def test_broadcast_pieces_that_differ_are_named_at_the_op_that_reads_them():
    def body(rank):
        bad = torch.full((3,), float(rank)).to_global(P2, B, sync_data=False)
        with gt.verify():
            try:
                (bad * 2).sum()
            except gt.GlobalTensorError as error:
                return str(error)

    text = _errors(body)[0]
    assert "aten.mul.Tensor" in text and "holds pieces that disagree between ranks" in text


def test_random_ops_are_recorded_as_skipped_and_arguments_are_checked():
    def body(rank):
        x = gt.ones(4, 6, placement=P2, sbp=S(0))
        with gt.verify(mode="report", show=False) as v:
            torch.nn.functional.dropout(x, 0.5, training=True)
        return [(r.op, r.diff.note) for r in v.records]

    records = _errors(body)[0]
    assert any("dropout" in op or "bernoulli" in op for op, note in records
               if note == "random: not recomputed"), records
    with pytest.raises(gt.GlobalTensorError, match="expected mode 'raise' or 'report'"):
        gt.verify(mode="loud")
    with pytest.raises(gt.GlobalTensorError, match="expected rtol >= 0"):
        gt.verify(rtol=-1.0)


def test_ops_that_draw_nothing_are_recomputed():
    """Attention (``dropout_p=0``) and dropout in eval carry torch's random tag but draw
    nothing: they are checked like any op (a wrong attention rule once hid behind the tag)."""
    def body(rank):
        q = gt.ones(2, 4, 3, 2, placement=P2, sbp=S(1))
        kv = gt.ones(2, 2, 3, 2, placement=P2, sbp=B)
        with gt.verify(mode="report", show=False) as v:
            torch.nn.functional.scaled_dot_product_attention(q, kv, kv, enable_gqa=True)
            torch.nn.functional.dropout(q, 0.5, training=False)
        return [(r.op, r.diff.note, r.diff.ok) for r in v.records]

    records = _errors(body)[0]
    attention = [r for r in records if "scaled_dot_product" in r[0]]
    assert attention and all(note != "random: not recomputed" and ok for _, note, ok in attention)


transformers = pytest.importorskip("transformers")


@pytest.mark.slow  # ~15 s; the planted-bug tests run by default
def test_a_correct_llama_tensor_and_data_parallel_step_reports_nothing():
    from ranks.test_real_models import IDS, llama, megatron

    base = llama("eager")

    def body(rank):
        model = copy.deepcopy(base)
        placement = gt.placement("cpu", [[0, 1], [2, 3]])
        model.to_global(placement, megatron)
        ids = gt.tensor(IDS, placement=placement, sbp=(S(0), B))
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        with gt.verify(mode="report", show=False) as v:
            model(ids, labels=ids).loss.backward()
            opt.step()
        return len(v.records), [str(r.row()) for r in v.failures], \
            {r.op for r in v.records}

    for count, failures, ops in run_ranks(body, 4, timeout=480):
        assert failures == []
        assert count > 200
        assert {"aten.mm.default", "aten.embedding.default", "aten._softmax.default"} <= ops


def test_an_output_is_gathered_once_not_again_as_the_next_ops_input(monkeypatch):
    """issue 41: each op's inputs were gathered again although the op before had just gathered
    them as its outputs. A piece written since (its version moved) is gathered again."""
    import importlib

    verify_module = importlib.import_module("globaltensor.tools.verify")
    sent = {}
    real = verify_module.all_objects

    def counting(obj, what, *args, **kwargs):
        if isinstance(obj, tuple) and gt.env.get_rank() == 0:
            sent.setdefault(what, []).append(sum(isinstance(v, torch.Tensor) for v in obj[0]))
        return real(obj, what, *args, **kwargs)

    monkeypatch.setattr(verify_module, "all_objects", counting)
    full = torch.arange(16.0).reshape(4, 4) - 6

    def body(rank):
        p = gt.placement("cpu", [0, 1])
        x = gt.tensor(full, placement=p, sbp=S(0))
        with gt.verify():
            y = x.relu()       # x gathered as relu's input, y as its output
            z = y.neg()        # y known: not gathered again
            y._local.mul_(2)   # a write the verifier did not see: y is gathered again
            w = y + z
        return w.full_tensor()

    for got in run_ranks(body, 2, timeout=60):
        torch.testing.assert_close(got, full.relu())
    assert sent["gt.verify: aten.relu.default"] == [1]
    assert sent["gt.verify: aten.neg.default"] == [0]
    assert sent["gt.verify: aten.add.Tensor"] == [1]  # y again (written), z known
