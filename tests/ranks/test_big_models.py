"""Models larger than one process (SPEC "Models larger than one process", issue 53, first
part): a model built under ``torch.device("meta")`` takes layouts (``to_global``, an sbp plan,
``fully_shard``) as meta pieces with no data and no communication; torch's ``to_empty``
allocates each rank's pieces only, the same parameter objects; ``reset_parameters`` fills them
from gt's stream at global indices, so the full values are bitwise the same on 1 rank, a line
of 2 sharded, and a 2x2 grid of TP x fully_shard; using a model still on meta is a clear error
on every rank."""
import math

import pytest
import torch
import torch.nn as nn

import globaltensor as gt
from globaltensor.errors import GlobalTensorError
from globaltensor.testing import run_ranks

S, B = gt.sbp.split, gt.sbp.broadcast
TIMEOUT = 60
TP = gt.nn.sbp_plan({"0": gt.nn.colwise("tp"), "2": gt.nn.rowwise("tp")})


def _meta_model():
    with torch.device("meta"):
        return nn.Sequential(nn.Linear(8, 6), nn.ReLU(), nn.Linear(6, 8), nn.LayerNorm(8))


def _lay_out(model, how):
    if how == "one":
        gt.nn.fully_shard(model, gt.placement("cpu", [0]))
    elif how == "line":
        gt.nn.fully_shard(model, gt.placement("cpu", [0, 1]))
    else:
        grid = gt.placement("cpu", [[0, 1], [2, 3]], axes=("dp", "tp"))
        model.to_global(grid, TP)
        gt.nn.fully_shard(model, grid, "dp")
    return model


def _initialised(model):
    model.to_empty(device="cpu")
    gt.manual_seed(0)
    for module in model.modules():
        if hasattr(module, "reset_parameters"):
            module.reset_parameters()
    return {n: p.full_tensor() for n, p in model.named_parameters()}


def test_a_meta_model_takes_layouts_as_meta_pieces_without_communication():
    def body(rank):
        model = _meta_model()
        with gt.comm_trace() as trace:
            _lay_out(model, "2x2")
        return [(n, p.sbp, tuple(p.shape), tuple(p._local.shape), p._local.device.type)
                for n, p in model.named_parameters()], len(trace.records)
    for rank, (params, moves) in enumerate(run_ranks(body, 4, timeout=TIMEOUT)):
        assert moves == 0
        shapes = {n: (sbp, full, piece, dev) for n, sbp, full, piece, dev in params}
        # colwise weight (6, 8): S(0) on tp, sharded on dim 1 over dp -> (3, 4) pieces
        assert shapes["0.weight"] == ((S(1), S(0)), (6, 8), (3, 4), "meta")
        assert shapes["2.weight"] == ((S(0), S(1)), (8, 6), (4, 3), "meta")
        assert all(dev == "meta" for _, _, _, dev in shapes.values())


def test_to_empty_allocates_the_pieces_of_the_same_parameters_and_init_is_layout_free():
    """Full values after to_empty + reset_parameters: bitwise equal on 1 rank, a line of 2
    (fully_shard) and a 2x2 grid (TP x fully_shard); a Linear's bound is 1/sqrt(global fan_in)."""
    def body(rank, how):
        with gt.memory() as m:  # a meta tensor costs nothing; to_empty allocates the pieces
            model = _lay_out(_meta_model(), how)
            before = [id(p) for p in model.parameters()]
            laid_out = m.live_bytes()
            model.to_empty(device="cpu")
        full = _initialised(model)
        pieces = sum(p._local.numel() for p in model.parameters())
        assert laid_out == 0 and m.peak_bytes() == 4 * pieces, (laid_out, m.peak_bytes(), pieces)
        assert [id(p) for p in model.parameters()] == before  # the units still hold them
        assert all(p._local.device.type == "cpu" for p in model.parameters())
        x = gt.ones(4, 8, placement=model[0].weight.placement, sbp=[B] * model[0].weight.placement.ndim)
        y = model(x).full_tensor()
        return full, pieces, y
    one = run_ranks(body, 1, "one", timeout=TIMEOUT)[0]
    total = sum(t.numel() for t in one[0].values())
    for how, world in (("line", 2), ("2x2", 4)):
        for full, pieces, y in run_ranks(body, world, how, timeout=TIMEOUT):
            assert full.keys() == one[0].keys()
            for name in full:
                assert torch.equal(full[name], one[0][name]), (how, name)
            torch.testing.assert_close(y, one[2])  # (TP sums in another order: not bitwise)
            assert pieces < total  # each rank allocated its pieces, not the model
    weights = one[0]
    assert weights["0.weight"].abs().max() <= 8 ** -0.5 and weights["2.weight"].abs().max() <= 6 ** -0.5
    assert weights["0.weight"].abs().max() > 0.8 * 8 ** -0.5  # uniform over the whole bound
    assert torch.equal(weights["3.weight"], torch.ones(8))


@pytest.mark.parametrize("use", ["forward", "full_tensor", "bool", "step"])
@pytest.mark.parametrize("how", ["to_global", "fully_shard"])
def test_using_a_model_still_on_meta_is_a_clear_error_on_every_rank(use, how):
    def body(rank):
        model = _meta_model()
        placement = gt.placement("cpu", [0, 1])
        if how == "to_global":
            model.to_global(placement, B)
        else:
            gt.nn.fully_shard(model, placement)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        try:
            if use == "forward":
                model(gt.ones(2, 8, placement=placement, sbp=S(0)))
            elif use == "full_tensor":
                model[0].weight.full_tensor()
            elif use == "bool":
                bool(model[0].weight.sum() > 0)
            else:
                opt.step()
        except GlobalTensorError as e:
            return str(e)
        return None
    for message in run_ranks(body, 2, timeout=TIMEOUT):
        assert message is not None and "meta" in message and "to_empty(device=" in message
        if use == "forward":
            assert "0.weight (shape [6, 8]) is still on the meta device" in message


def test_real_tensors_beside_meta_ones_keep_their_values():
    def body(rank):
        model = nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 3, device="meta"))
        with torch.no_grad():
            model[0].weight.copy_(torch.arange(9.0).reshape(3, 3))
        model.to_global(gt.placement("cpu", [0, 1]), S(0))
        return model[0].weight.full_tensor(), model[1].weight._local.device.type
    for weight, device in run_ranks(body, 2, timeout=TIMEOUT):
        assert torch.equal(weight, torch.arange(9.0).reshape(3, 3)) and device == "meta"


def test_an_hf_llama_built_on_meta_and_sharded_initialises_as_on_one_rank():
    """HF's flow: build under torch.device("meta"), fully_shard per decoder layer and the root,
    to_empty, init_weights(): the state (rotary inv_freq included, which HF recomputes) is
    bitwise the one a 1-rank run gives, and the logits equal it."""
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(1))

    def body(rank, world):
        with torch.device("meta"):
            model = transformers.LlamaForCausalLM(config)
        placement = gt.placement("cpu", list(range(world)))
        for layer in model.model.layers:
            gt.nn.fully_shard(layer, placement)
        gt.nn.fully_shard(model, placement)
        model.to_empty(device="cpu")
        gt.manual_seed(0)
        model.init_weights()
        state = {k: v.full_tensor() for k, v in model.state_dict().items()}
        logits = model(gt.tensor(ids, placement=placement, sbp=B)).logits.full_tensor()
        return state, logits, model.model.rotary_emb.inv_freq.full_tensor()
    one = run_ranks(body, 1, 1, timeout=TIMEOUT)[0]
    reference = transformers.LlamaForCausalLM(config).model.rotary_emb.inv_freq
    assert torch.equal(one[2], reference)
    assert one[0]["model.layers.0.self_attn.q_proj.weight"].std() == pytest.approx(0.02, rel=0.2)
    for state, logits, _ in run_ranks(body, 2, 2, timeout=TIMEOUT):
        assert state.keys() == one[0].keys()
        assert all(torch.equal(state[k], one[0][k]) for k in state)
        torch.testing.assert_close(logits, one[1], atol=1e-5, rtol=1e-5)


def _llama_config():
    transformers = pytest.importorskip("transformers")
    return transformers, transformers.LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)


_LLAMA_TP = gt.nn.sbp_plan({
    "*.q_proj": gt.nn.colwise("tp"), "*.k_proj": gt.nn.colwise("tp"),
    "*.v_proj": gt.nn.colwise("tp"), "*.gate_proj": gt.nn.colwise("tp"),
    "*.up_proj": gt.nn.colwise("tp"), "*.o_proj": gt.nn.rowwise("tp"),
    "*.down_proj": gt.nn.rowwise("tp")})


def test_load_pretrained_reads_pieces_of_an_hf_folder_into_a_meta_built_2x2_model(tmp_path):
    """HF's own save_pretrained in one process, sharded into several files; on 4 ranks the model
    is built on meta, laid out TP x fully_shard, and loaded by pieces (no to_empty needed): each
    rank holds only its pieces, the logits equal one process's from_pretrained, and so does a
    training step."""
    transformers, config = _llama_config()
    torch.manual_seed(0)
    reference = transformers.LlamaForCausalLM(config)
    reference.save_pretrained(tmp_path, max_shard_size="20KB")
    assert (tmp_path / "model.safetensors.index.json").exists()
    one = transformers.LlamaForCausalLM.from_pretrained(tmp_path)
    ids = torch.randint(0, 64, (4, 8), generator=torch.Generator().manual_seed(1))
    expected = one(ids).logits.detach()
    opt = torch.optim.SGD(one.parameters(), lr=0.1)
    one(ids, labels=ids).loss.backward()
    opt.step()

    def body(rank):
        with torch.device("meta"):
            model = transformers.LlamaForCausalLM(config)
        grid = gt.placement("cpu", [[0, 1], [2, 3]], axes=("dp", "tp"))
        model.to_global(grid, _LLAMA_TP)
        for layer in model.model.layers:
            gt.nn.fully_shard(layer, grid, "dp")
        gt.nn.fully_shard(model, grid, "dp")
        with gt.memory() as m:  # only the pieces are allocated, none of the files' bytes
            gt.nn.load_pretrained(model, tmp_path)
        held = sum(t._local.numel() * t.element_size() for t in model.state_dict().values()
                   if not t._local.is_meta)
        assert held <= m.peak_bytes() <= held + 2 ** 16, (m.peak_bytes(), held)
        model.model.rotary_emb.to_empty(device="cpu")  # a buffer the file does not hold:
        model.model.rotary_emb.inv_freq.copy_(  # computed, as HF's init does
            gt.tensor(one.model.rotary_emb.inv_freq, placement=grid, sbp=B))
        pieces = sum(p._local.numel() for p in model.parameters())
        g_ids = gt.tensor(ids, placement=grid, sbp=(S(0), B))
        logits = model(g_ids).logits.full_tensor().detach()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        model(g_ids, labels=g_ids).loss.backward()
        opt.step()
        return pieces, logits, {n: p.full_tensor() for n, p in model.named_parameters()}
    total = sum(p.numel() for p in one.parameters())
    for pieces, logits, params in run_ranks(body, 4, timeout=120):
        assert pieces < total / 2
        torch.testing.assert_close(logits, expected, atol=1e-5, rtol=1e-5)
        for n, p in one.named_parameters():
            torch.testing.assert_close(params[n], p.detach(), atol=1e-5, rtol=1e-4, msg=n)


def _mapped(t, folder) -> bool:
    """Whether ``t``'s data lies in a mapping of a file of ``folder`` (/proc/self/maps)."""
    address = t.data_ptr()
    with open("/proc/self/maps") as f:
        for line in f:
            span, *_, path = line.split(maxsplit=5)
            low, high = (int(x, 16) for x in span.split("-"))
            if low <= address < high and path.strip().startswith(str(folder)):
                return True
    return False


def test_pieces_map_the_file_copy_on_write_and_a_save_over_the_folder_is_safe(tmp_path):
    """Split on dim 0 (fully_shard), each rank's pieces are private mappings of the files (as
    from_pretrained's weights are): a step writes them without touching the files; saving the
    trained model over the folder it maps (one file now, not three) replaces the files, removes
    the stale shards and index, and one process loads the trained values; mmap=False reads
    copies."""
    import hashlib
    transformers, config = _llama_config()
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(config).save_pretrained(tmp_path, max_shard_size="20KB")
    digest = {f.name: hashlib.sha256(f.read_bytes()).hexdigest() for f in tmp_path.iterdir()}
    ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(1))

    def body(rank, mapped):
        with torch.device("meta"):
            model = transformers.LlamaForCausalLM(config)
        line = gt.placement("cpu", [0, 1])
        for layer in model.model.layers:
            gt.nn.fully_shard(layer, line)
        gt.nn.fully_shard(model, line)
        gt.nn.load_pretrained(model, tmp_path, mmap=mapped)
        kinds = {_mapped(p._local, tmp_path) for p in model.parameters()}
        model.model.rotary_emb.to_empty(device="cpu")
        model.model.rotary_emb.inv_freq.copy_(gt.tensor(
            transformers.LlamaForCausalLM(config).model.rotary_emb.inv_freq, placement=line,
            sbp=B))
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        model(gt.tensor(ids, placement=line, sbp=S(0)), labels=gt.tensor(
            ids, placement=line, sbp=S(0))).loss.backward()
        opt.step()
        unchanged = {f.name: hashlib.sha256(f.read_bytes()).hexdigest()
                     for f in tmp_path.iterdir()} == digest
        gt.comm.barrier()
        if mapped:
            model.save_pretrained(tmp_path)
        return kinds, unchanged, {n: p.full_tensor() for n, p in model.named_parameters()}
    copied = run_ranks(body, 2, False, timeout=120)
    for kinds, unchanged, _ in copied:
        assert kinds == {False} and unchanged
    for kinds, unchanged, trained in run_ranks(body, 2, True, timeout=120):
        assert kinds == {True} and unchanged
        for n in trained:
            assert torch.equal(trained[n], copied[0][2][n]), n
    assert sorted(f.name for f in tmp_path.glob("model*")) == ["model.safetensors"]
    again = transformers.LlamaForCausalLM.from_pretrained(tmp_path)
    for n, p in again.named_parameters():
        assert torch.equal(p.detach(), trained[n]), n


def test_load_pretrained_reads_torch_files_renamed_keys_and_a_base_models_checkpoint(tmp_path):
    """HF's older folders (``pytorch_model.bin`` and its index, torch.save'd dicts) and a single
    file load by pieces like safetensors; ``key_mapping`` renames a checkpoint's keys (HF's
    argument); a base model's checkpoint (no ``model.`` prefix) loads into the head model, as
    from_pretrained does. Each into a meta-built fully_shard'ed model on 2 ranks, every value
    equal to the one saved."""
    import json
    transformers, config = _llama_config()
    torch.manual_seed(0)
    reference = transformers.LlamaForCausalLM(config)
    full = {k: v.detach().clone() for k, v in reference.state_dict().items()}
    legacy = tmp_path / "legacy"
    legacy.mkdir()
    names = sorted(full)
    halves = {"pytorch_model-00001-of-00002.bin": names[:len(names) // 2],
              "pytorch_model-00002-of-00002.bin": names[len(names) // 2:]}
    for file, keys in halves.items():
        torch.save({k: full[k] for k in keys}, legacy / file)
    (legacy / "pytorch_model.bin.index.json").write_text(json.dumps(
        {"weight_map": {k: f for f, keys in halves.items() for k in keys}}))
    torch.save({k.replace("mlp.", "ffn."): v for k, v in full.items()}, tmp_path / "renamed.pt")
    base = tmp_path / "base"
    reference.model.save_pretrained(base)  # the base model's keys: no "model." prefix

    def body(rank, where, key_mapping, head=True):
        with torch.device("meta"):
            model = (transformers.LlamaForCausalLM if head else transformers.LlamaModel)(config)
        line = gt.placement("cpu", [0, 1])
        gt.nn.fully_shard(model.get_decoder().layers[0], line)
        gt.nn.fully_shard(model, line)
        gt.nn.load_pretrained(model, where, key_mapping=key_mapping, strict=head)
        return {n: p.full_tensor() for n, p in model.named_parameters()}
    for where, mapping in ((legacy, None), (tmp_path / "renamed.pt", {r"\.ffn\.": ".mlp."})):
        for values in run_ranks(body, 2, where, mapping, timeout=120):
            for n, v in values.items():
                assert torch.equal(v, full[n]), (where, n)
    for values in run_ranks(body, 2, legacy, None, False, timeout=120):  # head's into the base
        assert values and all(torch.equal(v, full["model." + n]) for n, v in values.items())
    with pytest.raises(GlobalTensorError, match=r"missing keys \['lm_head.weight'\]"):
        run_ranks(body, 2, base, None, timeout=120)  # the base's: all but the head found


def test_load_pretrained_refuses_missing_extra_and_misshapen_keys_on_every_rank(tmp_path):
    transformers, config = _llama_config()
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(config).save_pretrained(tmp_path)
    wider = transformers.LlamaConfig(**{**config.to_dict(), "intermediate_size": 96})

    def body(rank, which):
        with torch.device("meta"):
            model = transformers.LlamaForCausalLM(wider if which == "shape" else config)
        if which == "missing":
            model.register_parameter("extra", nn.Parameter(torch.empty(3, device="meta")))
        model.to_global(gt.placement("cpu", [0, 1]), B)
        try:
            gt.nn.load_pretrained(model, tmp_path if which != "folder" else tmp_path / "nope")
        except GlobalTensorError as e:
            return str(e), model.model.embed_tokens.weight._local.is_meta
    for which, words in (("missing", "missing keys ['extra']"),
                         ("shape", "model.layers.0.mlp.gate_proj.weight: the model's [96, 32], "
                                   "the file's [64, 32]"),
                         ("folder", "does not exist")):
        for message, untouched in run_ranks(body, 2, which, timeout=60):
            assert words in message and untouched, (which, message)


def test_a_checkpoint_loads_into_a_model_built_on_meta_in_another_layout(tmp_path):
    """gt.checkpoint.save from a line of 2 (fully_shard); built on meta on a 2x2 grid of TP x
    fully_shard, to_empty, gt.checkpoint.load: the full values are the saved ones."""
    def save(rank):
        model = _lay_out(_meta_model(), "line")
        full = _initialised(model)
        gt.checkpoint.save(tmp_path, model=model)
        return full

    def load(rank):
        model = _lay_out(_meta_model(), "2x2")
        model.to_empty(device="cpu")
        gt.checkpoint.load(tmp_path, model=model)
        return {n: p.full_tensor() for n, p in model.named_parameters()}
    saved = run_ranks(save, 2, timeout=TIMEOUT)[0]
    for loaded in run_ranks(load, 4, timeout=TIMEOUT):
        assert loaded.keys() == saved.keys()
        assert all(torch.equal(loaded[n], saved[n]) for n in saved)


def test_the_meta_flow_runs_in_a_simulation_with_each_ranks_pieces():
    """gt.simulate of the flow (built on meta, TP x fully_shard on 2x2, to_empty, init, an AdamW
    step): the model built on meta costs nothing, as in the real run; to_empty allocates each
    rank's pieces, so its parameter peak is its pieces (never the whole model), and its
    optimizer state is two of its pieces and a step count each."""
    def build_and_step():
        model = _lay_out(_meta_model(), "2x2")
        model.to_empty(device="cpu")
        gt.manual_seed(0)
        for module in model.modules():
            if hasattr(module, "reset_parameters"):
                module.reset_parameters()
        grid = model[0].weight.placement
        opt = torch.optim.AdamW(model.parameters())
        model(gt.ones(4, 8, placement=grid, sbp=(S(0), B))).sum().backward()
        opt.step()
        return model
    with gt.simulate(4) as sim:
        gt.init()
        model = build_and_step()
    total = sum(p.numel() * 4 for p in model.parameters())
    for rank in range(4):
        coord = model[0].weight.placement.coord_of(rank)
        pieces = sum(math.prod(p._layout.local_shape(coord)) * 4 for p in model.parameters())
        assert pieces < total
        steps = 4 * len(list(model.parameters()))  # AdamW's step count: a float32 each
        assert sim.peak_bytes(rank, "optimizer") == 2 * pieces + steps, rank
        assert sim.peak_bytes(rank, "parameters") == pieces, (rank, pieces, total)


def test_laid_out_inside_the_meta_context_the_simulation_equals_the_real_run():
    """The layout done inside ``with torch.device("meta")`` (as well as after it), then
    to_empty and init: the real run sends nothing until then, and the simulation records
    nothing either (no metadata exchange, no broadcast: the real run makes meta pieces), with
    the same peak as gt.memory() in the real processes."""
    def flow():
        with torch.device("meta"):
            model = _lay_out(nn.Sequential(nn.Linear(8, 6), nn.ReLU(), nn.Linear(6, 8),
                                           nn.LayerNorm(8)), "2x2")
        model.to_empty(device="cpu")
        gt.manual_seed(0)
        for module in model.modules():
            if hasattr(module, "reset_parameters"):
                module.reset_parameters()

    def body(rank):
        with gt.comm_trace() as trace, gt.memory() as mem:
            flow()
        return trace.counts(metadata=True), mem.peak_bytes()
    real = run_ranks(body, 4, timeout=TIMEOUT)
    with gt.simulate(4) as sim:
        gt.init()
        flow()
    for rank, (counts, peak) in enumerate(real):
        assert sim.collectives(rank, metadata=True) == {} and sum(counts.values()) == 0, counts
        assert sim.peak_bytes(rank) == peak > 0, (rank, sim.peak_bytes(rank), peak)
