"""Expert parallelism (issue 56; docs/experts.md): unmodified HF mixture-of-experts models
(Qwen3-MoE, Mixtral, a DeepSeek-V3-style config with a shared expert and group-limited top-k
routing, Qwen2-MoE with a gated shared expert, top-4 and the aux loss; tiny configs, random
init) whose stacked experts are split on the axis that splits the
tokens dispatch the routed rows by all-to-all. Against one process: the loss, the router's aux
loss, every gradient and three AdamW steps, on a line (ep=4) and on a 2x2 (ep, tp) grid (each
expert's matrices split over "tp"); bf16 autocast; the bytes each rank sends are exactly its
routed rows' there and back, plus the counts."""
import copy

import pytest
import torch

import globaltensor as gt
from globaltensor.testing import run_ranks
from helpers import two_stage_losses

transformers = pytest.importorskip(
    "transformers", reason="HF transformers is a test dependency (pip install -e '.[test]')")

S, B = gt.sbp.split, gt.sbp.broadcast
TIMEOUT = 120
VOCAB, HIDDEN = 64, 32
IDS = torch.randint(0, VOCAB, (4, 8), generator=torch.Generator().manual_seed(1))
LINE = gt.placement("cpu", [0, 1, 2, 3], axes=("ep",))
GRID = gt.placement("cpu", [[0, 1], [2, 3]], axes=("ep", "tp"))
SMALL = dict(vocab_size=VOCAB, hidden_size=HIDDEN, num_hidden_layers=2, num_attention_heads=4,
             max_position_embeddings=64)


def qwen3_moe(**extra):
    return transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(
        **SMALL, intermediate_size=64, moe_intermediate_size=16, num_key_value_heads=2,
        head_dim=8, num_experts=8, num_experts_per_tok=2, output_router_logits=True, **extra))


def mixtral(**extra):
    return transformers.MixtralForCausalLM(transformers.MixtralConfig(
        **SMALL, intermediate_size=16, num_key_value_heads=2, head_dim=8, num_local_experts=8,
        num_experts_per_tok=2, output_router_logits=True, **extra))


def deepseek_v3(**extra):
    """DeepSeek-V3's shape: layer 0 dense, layer 1 eight routed experts (top-2 of 2 groups, 1
    group kept) beside a shared expert; latent attention."""
    return transformers.DeepseekV3ForCausalLM(transformers.DeepseekV3Config(
        **SMALL, intermediate_size=64, moe_intermediate_size=16, num_key_value_heads=4,
        n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=2, n_group=2,
        topk_group=1, first_k_dense_replace=1, kv_lora_rank=16, q_lora_rank=16,
        qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8, **extra))


def qwen2_moe(**extra):
    """Qwen2-MoE: 8 routed experts top-4 beside a gated shared expert, the aux loss on."""
    return transformers.Qwen2MoeForCausalLM(transformers.Qwen2MoeConfig(
        **SMALL, intermediate_size=64, moe_intermediate_size=16, num_key_value_heads=2,
        shared_expert_intermediate_size=32, num_experts=8, num_experts_per_tok=4,
        output_router_logits=True, **extra))


MODELS = {"qwen3_moe": qwen3_moe, "mixtral": mixtral, "deepseek_v3": deepseek_v3,
          "qwen2_moe": qwen2_moe}


def made(name):
    torch.manual_seed(0)
    model = MODELS[name]()
    assert model.config._experts_implementation == "grouped_mm"
    return model


def expert_parallel(name, t):
    """The stacked experts split on "ep"; everything else whole."""
    return S(0) if t.dim() == 3 else B


def ep_and_tp(name, t):
    """The stacked experts on "ep", each expert's Megatron pair on "tp": gate_up_proj
    (E, 2I, H) on its outputs, down_proj (E, H, I) on its inputs."""
    if t.dim() != 3:
        return (B, B)
    return (S(0), S(1) if "gate_up_proj" in name else S(2))


def steps(model, ids, n: int = 3, autocast: bool = False):
    """``n`` AdamW steps of HF's loss (the aux loss in it); per step the loss and the aux loss,
    and the first step's gradients."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses, grads = [], None
    for _ in range(n):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            out = model(ids, labels=ids)
        out.loss.backward()
        if grads is None:
            grads = {k: full(p.grad) for k, p in model.named_parameters()}
        opt.step()
        opt.zero_grad()
        aux = getattr(out, "aux_loss", None)
        losses.append((full(out.loss).item(), None if aux is None else full(aux).item()))
    return losses, grads


def full(t):
    return t.full_tensor() if isinstance(t, gt.GlobalTensor) else t


def check(name, placement, sbp_fn, ids_sbp, autocast=False, tol=(1e-4, 1e-5)):
    reference = made(name)
    base = copy.deepcopy(reference)
    want, want_grads = steps(reference, IDS, autocast=autocast)
    want_params = dict(reference.named_parameters())

    def body(rank):
        model = copy.deepcopy(base)
        model.to_global(placement, sbp_fn)
        ids = gt.tensor(IDS, placement=placement, sbp=ids_sbp)
        with gt.comm_trace() as trace:
            losses, grads = steps(model, ids, autocast=autocast)
        params = {k: full(p.detach()) for k, p in model.named_parameters()}
        kinds = trace.counts()
        return losses, grads, params, kinds

    rtol, atol = tol
    for losses, grads, params, kinds in run_ranks(body, 4, timeout=TIMEOUT):
        for (loss, aux), (want_loss, want_aux) in zip(losses, want):
            assert loss == pytest.approx(want_loss, rel=rtol, abs=atol)
            assert (aux is None) == (want_aux is None)
            if aux is not None:
                assert aux == pytest.approx(want_aux, rel=rtol, abs=atol)
        for k, g in grads.items():
            torch.testing.assert_close(g, want_grads[k], rtol=rtol * 10, atol=atol * 10,
                                       msg=lambda m, k=k: f"{k}: {m}")
        for k, p in params.items():
            torch.testing.assert_close(p, want_params[k].detach(), rtol=rtol * 10,
                                       atol=atol * 10, msg=lambda m, k=k: f"{k}: {m}")
        assert kinds.get("all_to_all", 0) > 0  # the dispatch ran
    return want


@pytest.mark.parametrize("name", ["qwen3_moe", "deepseek_v3", *(
    pytest.param(n, marks=pytest.mark.slow) for n in ("mixtral", "qwen2_moe"))])
def test_three_adamw_steps_with_experts_split_over_4_ranks_equal_one_process(name):
    check(name, LINE, expert_parallel, S(0))


@pytest.mark.parametrize("name", ["qwen3_moe", *(pytest.param(n, marks=pytest.mark.slow)
                                                for n in ("mixtral", "deepseek_v3", "qwen2_moe"))])
def test_three_adamw_steps_on_an_ep_x_tp_grid_equal_one_process(name):
    check(name, GRID, ep_and_tp, (S(0), B))


@pytest.mark.parametrize("name", ["qwen3_moe", *(pytest.param(n, marks=pytest.mark.slow)
                                                for n in ("mixtral", "deepseek_v3", "qwen2_moe"))])
def test_bf16_autocast_with_experts_split_equals_one_process(name):
    check(name, LINE, expert_parallel, S(0), autocast=True, tol=(2e-2, 2e-2))


def _routed(name):
    """Per MoE layer, the top-k expert indices of each token of one process's forward."""
    model = made(name)
    found = []
    for module in model.modules():
        if hasattr(module, "_is_expert_parallel"):
            module.register_forward_pre_hook(lambda m, args: found.append(args[1].clone()))
    model(IDS, labels=IDS)
    return found


def test_each_rank_sends_its_routed_rows_there_and_back_and_the_counts():
    """comm_trace's rows of one forward, per MoE layer: the counts (to each other member its
    rows, its pairs and the out-of-range count: three int64), each pair's row and local expert
    (one int64), the hidden states of each token once per other member owning one of its
    choices (dispatch), the pairs' router weights (float32), and the result rows of the
    other ranks' tokens that came here (combine): nothing else."""
    routed = _routed("qwen3_moe")
    base = made("qwen3_moe")

    def body(rank):
        model = copy.deepcopy(base)
        model.to_global(LINE, expert_parallel)
        ids = gt.tensor(IDS, placement=LINE, sbp=S(0))
        with gt.comm_trace() as trace:
            model(ids, labels=ids)
        return [(r.op, r.bytes_per_rank) for r in trace.records if r.kind == "expert exchange"]

    tokens, row = IDS.numel() // 4, HIDDEN * 4
    for rank, rows in enumerate(run_ranks(body, 4, timeout=TIMEOUT)):
        want = []
        for choices in routed:
            owner = choices // 2  # experts 2r and 2r+1 are rank r's
            source = torch.arange(IDS.numel()) // tokens
            held = torch.zeros(IDS.numel(), 4, dtype=torch.bool)
            held[torch.arange(IDS.numel()).unsqueeze(1), owner] = True  # token t reaches g
            pairs = int(((source.unsqueeze(1) == rank) & (owner != rank)).sum())
            there = int(held[source == rank].sum() - held[source == rank, rank].sum())
            back = int(held[source != rank, rank].sum())
            want += [("experts counts (Qwen3MoeExperts)", 3 * 3 * 8),
                     ("experts pairs (Qwen3MoeExperts)", pairs * 8),
                     ("experts dispatch (Qwen3MoeExperts)", there * row),
                     ("experts weights (Qwen3MoeExperts)", pairs * 4),
                     ("experts combine (Qwen3MoeExperts)", back * row)]
        assert rows == want, rank


def _experts(num_experts: int):
    """HF's Qwen3-MoE experts module alone (as transformers builds it), initialised."""
    config = transformers.Qwen3MoeConfig(hidden_size=HIDDEN, moe_intermediate_size=16,
                                         num_experts=num_experts, num_experts_per_tok=2)
    config._experts_implementation = "grouped_mm"
    module = transformers.models.qwen3_moe.modeling_qwen3_moe.Qwen3MoeExperts(config)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.2)
    return module


def _call(module, index, placement=LINE):
    """The module on 13 tokens split over the placement (uneven: 4, 3, 3, 3), the given
    top-2 choices; the output, the hidden states' and the weights' gradients."""
    g = torch.Generator().manual_seed(1)
    hidden = torch.randn(13, HIDDEN, generator=g)
    weights = torch.rand(13, 2, generator=g)
    if isinstance(module.down_proj, gt.GlobalTensor):
        hidden, index, weights = (gt.tensor(t, placement=placement, sbp=S(0))
                                  for t in (hidden, index, weights))
    hidden.requires_grad_(True)
    weights.requires_grad_(True)
    out = module(hidden, index, weights)
    out.pow(2).sum().backward()
    grads = [full(hidden.grad), full(weights.grad)] + [full(p.grad) for p in module.parameters()]
    return full(out.detach()), grads


@pytest.mark.parametrize("method", ["all_to_all", "all_reduce"])
@pytest.mark.parametrize("experts,choices", [
    (6, "spread"),      # 6 experts over 4 ranks: 2, 2, 1, 1 (the uneven rule)
    (8, "two"),         # every token picks experts 0 and 1: ranks 1-3 receive nothing
    (3, "spread"),      # fewer experts than ranks: rank 3 owns none
], ids=["uneven", "idle-owners", "fewer-than-ranks"])
def test_uneven_experts_and_idle_owners_equal_one_process(experts, choices, method):
    g = torch.Generator().manual_seed(2)
    if choices == "two":
        index = torch.tensor([[0, 1]] * 13)
    else:
        index = torch.stack([torch.randperm(experts, generator=g)[:2] for _ in range(13)])
    module = _experts(experts)
    want, want_grads = _call(copy.deepcopy(module), index)

    def body(rank):
        mine = copy.deepcopy(module).to_global(LINE, lambda n, t: S(0))
        with gt.comm_trace() as trace:
            out, grads = _call(mine, index)
        return out, grads, trace.counts()

    before = gt.set_experts_method(method)  # the process's setting: every thread-rank's
    try:
        results = run_ranks(body, 4, timeout=TIMEOUT)
    finally:
        gt.set_experts_method(before)
    for out, grads, counts in results:
        torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-6)
        for got, expected in zip(grads, want_grads):
            torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)
        # forward: counts, pairs, rows, weights, results; backward: the mirrors of the three
        # differentiable ones
        assert (counts.get("all_to_all", 0) == 8) == (method == "all_to_all"), counts


@pytest.mark.parametrize("bad", [8, -1])
def test_an_expert_index_out_of_range_is_a_clear_error_on_every_rank(bad):
    """One rank's router gives an index outside [0, num_experts): every rank of the axis
    raises the same GlobalTensorError (the count travels with the counts), none hangs."""
    index = torch.tensor([[0, 1]] * 13)
    index[7, 1] = bad  # token 7: rank 2's (tokens 7-9)
    module = _experts(8)

    def body(rank):
        mine = copy.deepcopy(module).to_global(LINE, lambda n, t: S(0))
        with pytest.raises(gt.GlobalTensorError) as error:
            _call(mine, index)
        return str(error.value)

    for message in run_ranks(body, 4, timeout=TIMEOUT):
        assert "expected every top_k_index entry in [0, 8)" in message
        assert "found 1 out of range, on ranks [2]" in message


def test_experts_on_ep_and_fully_shard_of_the_rest_over_the_same_ranks():
    """torchtitan's EP x data: the experts split on "ep", every other weight fully_shard over
    the same four ranks (fully_shard leaves a parameter split on its axis as it is): three AdamW
    steps equal one process, and every MoE layer dispatched (8 all-to-alls a layer a step)."""
    reference = made("qwen3_moe")
    base = copy.deepcopy(reference)
    want, _ = steps(reference, IDS)
    want_params = dict(reference.named_parameters())

    def body(rank):
        model = copy.deepcopy(base)
        model.to_global(LINE, expert_parallel)
        for layer in model.model.layers:
            gt.nn.fully_shard(layer, LINE)
        gt.nn.fully_shard(model, LINE)
        ids = gt.tensor(IDS, placement=LINE, sbp=S(0))
        with gt.comm_trace() as trace:
            losses, _ = steps(model, ids)
        return losses, {k: full(p.detach()) for k, p in model.named_parameters()}, trace.counts()

    for losses, params, counts in run_ranks(body, 4, timeout=TIMEOUT):
        assert losses == [pytest.approx(w, rel=1e-5) for w in want]
        for k, p in params.items():
            torch.testing.assert_close(p, want_params[k].detach(), rtol=1e-3, atol=1e-4)
        assert counts["all_to_all"] == 3 * 2 * 8
        assert counts["reduce_scatter"] > 0  # the rest is sharded


def test_a_pipeline_stage_of_moe_blocks_dispatches_on_its_own_ranks():
    """Two stages on [0, 1] and [2, 3], each with HF's Qwen3-MoE sparse block (router and 8
    experts split over the stage's two ranks, the micro-batch's tokens split alike), 1F1B over
    2 micro-batches: three AdamW steps, the losses of one process."""
    import torch.nn as nn
    import torch.nn.functional as F
    block = transformers.models.qwen3_moe.modeling_qwen3_moe.Qwen3MoeSparseMoeBlock
    config = made("qwen3_moe").config
    torch.manual_seed(0)
    stages = [nn.Sequential(nn.Linear(8, HIDDEN), block(config)),
              nn.Sequential(block(config), nn.Linear(HIDDEN, 8))]
    for stage in stages:
        with torch.no_grad():
            for p in stage.parameters():
                p.normal_(0, 0.3)
    x, y = torch.randn(4, 6, 8), torch.randn(4, 6, 8)
    want = two_stage_losses(stages, x, y)

    def body(rank):
        first, second = copy.deepcopy(stages)
        left, right = gt.placement("cpu", [0, 1]), gt.placement("cpu", [2, 3])
        first.to_global(left, expert_parallel)
        second.to_global(right, expert_parallel)
        pipe = gt.nn.Pipeline([first, second], microbatches=2, schedule="1f1b")
        opt = torch.optim.AdamW(list(pipe.parameters()), lr=0.01)
        gx = gt.tensor(x, placement=left, sbp=S(0))
        gy = gt.tensor(y, placement=right, sbp=S(0))
        got = []
        with gt.comm_trace() as trace:
            for _ in range(3):
                opt.zero_grad()
                got.append(pipe.step(gx, target=gy, loss_fn=F.mse_loss))
                opt.step()
        return got, trace.counts().get("all_to_all", 0)

    for got, exchanges in run_ranks(body, 4, timeout=TIMEOUT):
        assert got == pytest.approx(want, rel=1e-5)
        assert exchanges == 3 * 2 * 8  # its stage's block: 2 micro-batches a step


def test_gt_simulate_counts_the_dispatch_of_an_even_router():
    """gt.simulate of a Qwen3-MoE step with the experts split: the collectives of the real run
    on every rank, and all_to_all bytes of a router choosing uniformly: each member gets 4 of
    a rank's 16 pairs, and round(8 (1 - C(6, 2) / C(8, 2))) = 4 of its 8 tokens as rows."""
    config = made("qwen3_moe").config

    def job():
        gt.init()
        torch.manual_seed(0)
        model = transformers.Qwen3MoeForCausalLM(config)
        model.to_global(LINE, expert_parallel)
        ids = gt.randint(0, VOCAB, (4, 8), placement=LINE, sbp=S(0))
        model(ids, labels=ids).loss.backward()

    def body(rank):
        with gt.comm_trace() as trace:
            job()
        return trace.counts()

    real = run_ranks(body, 4, timeout=TIMEOUT)
    with gt.simulate(4) as sim:
        job()
    rows, pairs = 12 * HIDDEN * 4, 12  # to the 3 other members
    counts = 3 * 3 * 8
    # forward: counts, pairs (int64), rows, weights (float32), results; backward: the
    # mirrors of the rows, the weights and the results
    per_layer = counts + pairs * 8 + 2 * (rows + pairs * 4 + rows)
    for rank, got in enumerate(real):
        assert sim.collectives(rank) == got, rank
        assert sim.comm_bytes(rank)["all_to_all"] == 2 * per_layer, rank


@pytest.mark.slow  # 9 s: a 1-rank and a 4-rank build and init
def test_a_qwen3_moe_built_on_meta_with_its_experts_split_initialises_as_on_one_rank():
    """The big-model flow with expert parallelism: build under torch.device("meta"), lay the
    experts out on "ep", to_empty, init_weights(): the state is bitwise the one a 1-rank run
    gives (layout-independent initialisation), and the loss, computed by dispatch, equals it."""
    config = made("qwen3_moe").config

    def body(rank, world):
        with torch.device("meta"):
            model = transformers.Qwen3MoeForCausalLM(config)
        placement = gt.placement("cpu", list(range(world)), axes=("ep",))
        model.to_global(placement, expert_parallel)
        model.to_empty(device="cpu")
        gt.manual_seed(0)
        model.init_weights()
        state = {k: full(v) for k, v in model.state_dict().items()}
        ids = gt.tensor(IDS, placement=placement, sbp=S(0))
        with gt.comm_trace() as trace:
            loss = full(model(ids, labels=ids).loss).item()
        return state, loss, trace.counts().get("all_to_all", 0)

    one = run_ranks(body, 1, 1, timeout=TIMEOUT)[0]
    for state, loss, exchanges in run_ranks(body, 4, 4, timeout=TIMEOUT):
        assert state.keys() == one[0].keys()
        assert all(torch.equal(state[k], one[0][k]) for k in state)
        assert loss == pytest.approx(one[1], rel=1e-5)
        assert exchanges == 2 * 5  # each layer's forward dispatch


def test_a_checkpoint_of_expert_parallel_training_resumes_on_an_ep_x_tp_grid(tmp_path):
    """Two AdamW steps with the experts on ep=4, gt.checkpoint.save (model and optimizer);
    loaded into the 2x2 (ep, tp) layout, one more step: the loss and the parameters of three
    uninterrupted steps in one process."""
    reference = made("qwen3_moe")
    base = copy.deepcopy(reference)
    want, _ = steps(reference, IDS)
    want_params = dict(reference.named_parameters())

    def first(rank):
        model = copy.deepcopy(base).to_global(LINE, expert_parallel)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        ids = gt.tensor(IDS, placement=LINE, sbp=S(0))
        for _ in range(2):
            model(ids, labels=ids).loss.backward()
            opt.step()
            opt.zero_grad()
        gt.checkpoint.save(tmp_path / "ckpt", model=model, optimizer=opt)

    def resumed(rank):
        model = copy.deepcopy(base).to_global(GRID, ep_and_tp)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        gt.checkpoint.load(tmp_path / "ckpt", model=model, optimizer=opt)
        ids = gt.tensor(IDS, placement=GRID, sbp=(S(0), B))
        loss = model(ids, labels=ids).loss
        loss.backward()
        opt.step()
        return full(loss).item(), {k: full(p.detach()) for k, p in model.named_parameters()}

    run_ranks(first, 4, timeout=TIMEOUT)
    for loss, params in run_ranks(resumed, 4, timeout=TIMEOUT):
        assert loss == pytest.approx(want[2][0], rel=1e-5)
        for k, p in params.items():
            torch.testing.assert_close(p, want_params[k].detach(), rtol=1e-3, atol=1e-4)
