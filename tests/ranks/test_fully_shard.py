"""gt.nn.fully_shard as a torchtitan user spells it (one unit per block, then the root), against
one process: 1-D and 2x2 (TP x FSDP) grids, uneven pieces, mixed precision, both reshard
choices, gradient accumulation without sync, explicit prefetch, unshard/reshard, activation
checkpointing inside a unit, checkpoints into another layout, an HF model, and the memory bound
(at most two units gathered at once) read through gt.memory()."""
import copy

import pytest
import torch

import globaltensor as gt
from globaltensor.errors import GlobalTensorError
from globaltensor.testing import run_ranks

from helpers import REF_NET as REF, X_NET as X, Net, assert_matches, full_state, one_process, shard

S, B = gt.sbp.split, gt.sbp.broadcast
TIMEOUT = 90
LINE2 = gt.placement("cpu", [0, 1])
LINE4 = gt.placement("cpu", [0, 1, 2, 3])
GRID = gt.placement("cpu", [[0, 1], [2, 3]], axes=("dp", "tp"))


def train(model, placement, steps=3, micro=1, batch_sbp=None, **kwargs):
    """The same loop on global tensors; ``micro`` micro-batches accumulate without sync."""
    m = shard(copy.deepcopy(model), placement, **kwargs)
    opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
    sbp = batch_sbp or S(0)
    losses = []
    for _ in range(steps):
        for i, x in enumerate(X.chunk(micro)):
            m.set_requires_gradient_sync(i == micro - 1)
            xg = x.to_global(placement, B).to_global(sbp=sbp)
            loss = m(xg).pow(2).mean() / micro
            loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, m


@pytest.mark.parametrize("world,reshard", [(2, True), (4, True), (2, False)])
def test_training_equals_one_process_uneven_pieces(world, reshard):
    expected = one_process(REF)
    placement = LINE2 if world == 2 else LINE4

    def body(rank):
        losses, m = train(REF, placement, reshard_after_forward=reshard)
        assert all(p.sbp[0] == S(0) for p in m.parameters() if p.dim() >= 1)
        return losses, full_state(m)
    for got in run_ranks(body, world, timeout=TIMEOUT):
        assert_matches(expected, got)


def test_one_gather_and_one_reduce_scatter_per_unit_and_step():
    def body(rank):
        m = shard(copy.deepcopy(REF), LINE4)
        x = X.to_global(LINE4, B).to_global(sbp=S(0))
        m(x).pow(2).mean().backward()  # the first step records the order
        with gt.comm_trace() as trace:
            m(x).pow(2).mean().backward()
        return [r.op for r in trace.records if "fully_shard" in r.op]
    ops = run_ranks(body, 4, timeout=TIMEOUT)[0]
    gathers = [op for op in ops if "all_gather" in op]
    scatters = [op for op in ops if "reduce_scatter" in op]
    # forward: root and 3 blocks; backward: the 3 blocks again (the root stays gathered)
    assert len(gathers) == 7 and len(scatters) == 4


def test_gradient_accumulation_without_sync_equals_the_whole_batch():
    expected = one_process(REF, micro=2)

    def body(rank):
        m = shard(copy.deepcopy(REF), LINE2)
        x = X.to_global(LINE2, B).to_global(sbp=S(0))
        m.set_requires_gradient_sync(False)
        with gt.comm_trace() as trace:
            (m(x[:6]).pow(2).mean() / 2).backward()
        no_sync = [r.op for r in trace.records if "reduce_scatter" in r.op]
        assert all(p.grad is None for p in m.parameters())
        m.set_requires_gradient_sync(True)
        (m(x[6:]).pow(2).mean() / 2).backward()
        assert all(p.grad is not None for p in m.parameters())
        losses, trained = train(REF, LINE2, micro=2)
        return no_sync, losses, full_state(trained)
    for no_sync, losses, state in run_ranks(body, 2, timeout=TIMEOUT):
        assert no_sync == []
        assert_matches(expected, (losses, state))


def test_explicit_prefetch_lists_unshard_and_reshard():
    expected = one_process(REF)

    def body(rank):
        m = shard(copy.deepcopy(REF), LINE2)
        layers = list(m.layers)
        for i, layer in enumerate(layers):
            layer.set_modules_to_forward_prefetch(layers[i + 1:i + 3])
            layer.set_modules_to_backward_prefetch(layers[max(0, i - 2):i][::-1])
        opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
        losses = []
        for _ in range(3):
            m.unshard()  # gathered ahead of the forward, used by it
            loss = m(X.to_global(LINE2, B).to_global(sbp=S(0))).pow(2).mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
        handle = layers[0].unshard(async_op=True)
        handle.wait()
        layers[0].reshard()
        assert not layers[0].__dict__["_gt_fsdp_unit"].comm.unsharded
        return losses, full_state(m)
    for got in run_ranks(body, 2, timeout=TIMEOUT):
        assert_matches(expected, got)


def test_activation_checkpointing_inside_a_unit():
    remat = copy.deepcopy(REF)
    for block in remat.layers:
        block.remat = True  # torch.utils.checkpoint around the block's inner part
    expected = one_process(remat)

    def body(rank):
        with gt.comm_trace() as plain:
            train(REF, LINE2)
        with gt.comm_trace() as t:
            losses, m = train(remat, LINE2)
        # the recomputation computes with the unit's gathered parameters: it sends what the
        # same steps without checkpointing send, no operator gathers a piece of its own
        assert t.counts() == plain.counts() and t.bytes_per_rank == plain.bytes_per_rank
        return losses, full_state(m)
    for got in run_ranks(body, 2, timeout=TIMEOUT):
        assert_matches(expected, got)


def test_tensor_parallel_then_fully_shard_on_a_2x2_grid():
    """TP by to_global with an sbp_fn on "tp", then fully_shard over "dp": the TP layouts stay
    (a weight split on dim 0 by tp is sharded on dim 1 over dp: one all-gather still)."""
    expected = one_process(REF)
    tp = gt.nn.sbp_plan({"layers.*.up": gt.nn.colwise("tp"), "layers.*.down": gt.nn.rowwise("tp")})

    def body(rank):
        m = copy.deepcopy(REF)
        m.to_global(GRID, tp)
        m = shard(m, GRID, "dp")
        up = m.layers[0].up.weight
        assert up.sbp == (S(1), S(0)), up.sbp
        assert m.layers[0].up.bias.sbp == (B, S(0))  # 1-D and split by tp: kept broadcast on dp
        assert m.layers[0].down.weight.sbp == (S(0), S(1))
        opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
        losses = []
        for _ in range(3):
            x = X.to_global(GRID, (S(0), B))
            loss = m(x).pow(2).mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
        return losses, full_state(m)
    for got in run_ranks(body, 4, timeout=TIMEOUT):
        assert_matches(expected, got)


def test_mixed_precision_gathers_half_the_bytes_and_stays_near_fp32():
    def body(rank, policy):
        m = shard(copy.deepcopy(REF), LINE2, mp_policy=policy)
        x = X.to_global(LINE2, B).to_global(sbp=S(0))
        m(x).float().pow(2).mean().backward()  # the first step records the order
        m.zero_grad()
        with gt.comm_trace() as trace:
            loss = m(x).float().pow(2).mean()
            loss.backward()
        sent = sum(r.bytes_per_rank for r in trace.records if "fully_shard all_gather" in r.op)
        grads = {n: p.grad.full_tensor() for n, p in m.named_parameters()}
        assert all(p.dtype == torch.float32 and p.grad.dtype == torch.float32
                   for p in m.parameters())
        return loss.item(), sent, grads
    fp32 = run_ranks(body, 2, None, timeout=TIMEOUT)[0]
    bf16 = run_ranks(body, 2, gt.nn.MixedPrecision(torch.bfloat16, torch.float32),
                     timeout=TIMEOUT)[0]
    assert bf16[1] * 2 == fp32[1]
    assert bf16[0] == pytest.approx(fp32[0], rel=2e-2)
    for name, g in fp32[2].items():
        torch.testing.assert_close(bf16[2][name], g, atol=3e-2, rtol=5e-2, msg=name)


def test_saved_from_fully_shard_loads_into_another_layout(tmp_path):
    def save(rank):
        _, m = train(REF, LINE4, steps=2)
        gt.checkpoint.save(tmp_path / "ckpt", model=m)
        return full_state(m)

    saved = run_ranks(save, 4, timeout=TIMEOUT)[0]

    def load(rank):
        m = copy.deepcopy(Net())
        m.to_global(GRID, gt.nn.sbp_plan({"layers.*.up": gt.nn.colwise("tp")}))
        gt.checkpoint.load(tmp_path / "ckpt", model=m)
        back = shard(Net(), LINE4, shard_dim=lambda name, p: p.dim() - 1)
        gt.checkpoint.load(tmp_path / "ckpt", model=back)
        return full_state(m), full_state(back)
    for tp, sharded in run_ranks(load, 4, timeout=TIMEOUT):
        for k, v in saved.items():
            torch.testing.assert_close(tp[k], v, atol=0, rtol=0, msg=k)
            torch.testing.assert_close(sharded[k], v, atol=0, rtol=0, msg=k)


def test_memory_holds_at_most_two_units_gathered():
    """16 blocks of hidden 32: the gathered units in flight (communication) stay within two
    units, with gloo's own buffers beside them (a copy of the gather in flight until its wait,
    and of the gradients a unit reduce-scatters: wire.Workspace); the model is never gathered."""
    big = Net(h=32, n=16)
    unit_bytes = sum(p.numel() * 4 for p in big.layers[0].parameters())
    model_bytes = sum(p.numel() * 4 for p in big.parameters())
    del big  # (a plain model in a frame is not counted by gt.memory(); the ranks build their own)

    def body(rank):
        m = shard(Net(h=32, n=16), LINE2)  # the first rank's values: the same on both
        x = X.to_global(LINE2, B).to_global(sbp=S(0))
        m(x).pow(2).mean().backward()
        with gt.memory() as mem:
            m(x).pow(2).mean().backward()
        root = m.__dict__["_gt_fsdp_unit"].comm.numel * 4  # the root stays gathered
        return mem.peak_bytes("communication") - root, mem.peak_bytes("parameters"), mem.report()
    for comm, params, report in run_ranks(body, 2, timeout=TIMEOUT):
        assert 0 < comm <= (2 + 2) * unit_bytes * 1.05, report
        assert comm < model_bytes / 3, report
        assert params <= model_bytes / 2 * 1.2, report


def test_an_hf_model_sharded_block_by_block_equals_one_process():
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, attn_implementation="sdpa"))
    ids = torch.randint(0, 96, (4, 10), generator=torch.Generator().manual_seed(1))
    ref = copy.deepcopy(hf)
    loss_ref = ref(input_ids=ids, labels=ids).loss
    loss_ref.backward()
    grads_ref = {n: p.grad for n, p in ref.named_parameters()}

    def body(rank):
        m = copy.deepcopy(hf)
        for layer in m.model.layers:
            gt.nn.fully_shard(layer, LINE2)
        gt.nn.fully_shard(m, LINE2)
        g_ids = ids.to_global(LINE2, B).to_global(sbp=S(0))
        loss = m(input_ids=g_ids, labels=g_ids).loss
        loss.backward()
        return loss.item(), {n: p.grad.full_tensor() for n, p in m.named_parameters()}
    for loss, grads in run_ranks(body, 2, timeout=TIMEOUT):
        assert loss == pytest.approx(loss_ref.item(), abs=1e-5)
        for n, g in grads_ref.items():
            torch.testing.assert_close(grads[n], g, atol=1e-5, rtol=1e-4, msg=n)


@pytest.mark.parametrize("case", ["axis", "no_axis_on_a_grid", "twice", "ranks", "shard_dim", "policy"])
def test_bad_input_is_a_clear_error_on_every_rank(case):
    def body(rank):
        m = Net()
        try:
            if case == "axis":
                gt.nn.fully_shard(m, GRID, axis="pp")
            elif case == "no_axis_on_a_grid":
                gt.nn.fully_shard(m, GRID)
            elif case == "twice":
                gt.nn.fully_shard(m, LINE4)
                gt.nn.fully_shard(m, LINE4)
            elif case == "ranks":
                m.to_global(LINE4)
                gt.nn.fully_shard(m, gt.placement("cpu", [0, 1]))
            elif case == "shard_dim":
                gt.nn.fully_shard(m, LINE4, shard_dim=5)
            else:
                gt.nn.fully_shard(m, LINE4, mp_policy=torch.bfloat16)
        except GlobalTensorError as e:
            return str(e)
        return None
    messages = run_ranks(body, 4, timeout=TIMEOUT)
    assert all(m is not None and m == messages[0] for m in messages), messages
    expected = {"axis": "'pp'", "no_axis_on_a_grid": "name the one to shard over",
                "twice": "sharded already", "ranks": "does not hold", "shard_dim": "shard_dim",
                "policy": "MixedPrecision"}[case]
    assert expected in messages[0]



HSDP = gt.placement("cpu", [[0, 1], [2, 3]], axes=("dp", "fsdp"))


def test_hsdp_reduce_scatters_first_then_all_reduces_the_shard_over_dp():
    """FSDP2's HSDP (``fully_shard(m, mesh=2-D)`` with a replicate dim): fully_shard on "fsdp"
    of a ("dp", "fsdp") grid, the batch split on both. Each unit's gradients are reduce-scattered
    over "fsdp" first, then its 1/2 shard all-reduced over "dp" (one per unit): no gradient is
    all-reduced whole. Numbers equal one process."""
    expected = one_process(REF)

    def body(rank):
        losses, m = train(REF, HSDP, axis="fsdp", batch_sbp=(S(0), S(0)))
        x = X.to_global(HSDP, B).to_global(sbp=(S(0), S(0)))
        with gt.comm_trace() as trace:
            m(x).pow(2).mean().backward()
        m.zero_grad()
        units = [(r.op, r.bytes_per_rank) for r in trace.records if "fully_shard" in r.op]
        others = [r.collectives for r in trace.records if "fully_shard" not in r.op
                  and r.target is not None and r.target.shape != ()]
        return (losses, full_state(m)), units, others
    for got, units, others in run_ranks(body, 4, timeout=TIMEOUT):
        assert_matches(expected, got)
        scatters = [b for op, b in units if "reduce_scatter" in op]
        reduces = [b for op, b in units if "all_reduce" in op]
        assert len(scatters) == 4 and len(reduces) == 4  # 3 blocks and the root, one each
        # a ring of 2: reduce-scatter sends half the buffer, the all-reduce of the half shard
        # sends that half once more (2 (n-1)/n of it): the same bytes, not the whole gradient
        assert reduces == scatters
        assert not any("all_reduce" in c for cs in others for c in cs), others
