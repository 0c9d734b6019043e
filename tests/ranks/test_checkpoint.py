"""Checkpoints with torch.distributed.checkpoint (DCP): global tensors describe their pieces to
DCP's planners, so each rank writes what it owns and loading reshards into any layout, any
world size, or plain tensors in one process. gt.checkpoint.save / load wrap it for a model, its
optimizer and extra values, and turn bad input into one GlobalTensorError on every rank."""
import os
import threading

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save, torch_save_to_dcp

import globaltensor as gt
from globaltensor.errors import GlobalTensorError
from globaltensor.layout import Layout
from globaltensor.testing import run_ranks

from helpers import error_or_none, full_of, make_global, random_cases, train_mse

S, B, P = gt.sbp.split, gt.sbp.broadcast, gt.sbp.partial_sum
G22 = gt.placement("cpu", [[0, 1], [2, 3]])
G2 = gt.placement("cpu", [0, 1])
TIMEOUT = 60

DTYPES = [torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64,
          torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.complex64,
          torch.complex128, torch.float8_e4m3fn]
SHAPES = {"a": (7, 5), "b": (5, 3, 2), "c": (3,), "d": ()}  # uneven on a 2x2 grid, 3 < 4 rows


def value(shape, dtype, seed=0):
    """Distinct small values (exact in every dtype)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(-8, 9, shape, generator=g, dtype=torch.int64)
    if dtype == torch.bool:
        return x > 0
    if dtype == torch.uint8:
        return (x + 8).to(dtype)
    if dtype.is_complex:
        return torch.complex(x.double(), -x.double()).to(dtype)
    return x.to(dtype)


def full_values():
    """One tensor per (shape, dtype): ``a.float32`` -> value."""
    return {f"{name}.{str(dt).split('.')[1]}": value(shape, dt, seed=i)
            for i, (dt, (name, shape)) in enumerate((dt, s) for dt in DTYPES for s in SHAPES.items())}


def sbp_2x2(shape):
    """(S(0), S(1)); (S(0), S(0)) for a 1-D tensor (nested splits), (B, B) for a scalar."""
    return {0: (B, B), 1: (S(0), S(0))}.get(len(shape), (S(0), S(1)))


def save_2x2(path):
    fulls = full_values()

    def body(rank):
        state = {k: make_global(v, Layout(G22, sbp_2x2(v.shape), v.shape), rank)
                 for k, v in fulls.items()}
        dcp.save(state, checkpoint_id=path)
        return {k: tuple(t.to_local().shape) for k, t in state.items()}

    return fulls, run_ranks(body, 4, timeout=TIMEOUT)


def load_on(path, fulls, placement, sbp_of, world):
    def body(rank):
        state = {k: make_global(torch.zeros_like(v), Layout(placement, sbp_of(v), v.shape), rank)
                 for k, v in fulls.items()}
        dcp.load(state, checkpoint_id=path)
        return {k: (t.full_tensor(), t.sbp) for k, t in state.items()}

    return run_ranks(body, world, timeout=TIMEOUT)


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")  # dcp.load in one process
def test_saved_on_a_2x2_grid_loads_as_s1_as_b_and_in_one_process(tmp_path):
    path = str(tmp_path / "ckpt")
    fulls, local_shapes = save_2x2(path)
    assert local_shapes[0]["a.float32"] == (4, 3) and local_shapes[3]["a.float32"] == (3, 2)
    assert local_shapes[3]["c.float32"] == (0,)  # 3 rows over 4 ranks: an empty piece
    # each tensor's chunks in the checkpoint are the boxes of its layout, each written once
    meta = dcp.FileSystemReader(path).read_metadata()
    layout = Layout(G22, sbp_2x2((7, 5)), (7, 5))
    boxes = {(tuple(lo for lo, _ in b), tuple(hi - lo for lo, hi in b))
             for b in (layout.box(c) for c in [(0, 0), (0, 1), (1, 0), (1, 1)])}
    chunks = meta.state_dict_metadata["a.int64"].chunks
    assert {(tuple(c.offsets), tuple(c.sizes)) for c in chunks} == boxes and len(chunks) == 4

    for placement, sbp_of, world in [
            (G2, lambda v: S(v.dim() - 1) if v.dim() else B, 2),  # S(1) (S(0) for 1-D)
            (G2, lambda v: B, 2),
            (gt.placement("cpu", [[1], [0]]), lambda v: (B, S(0) if v.dim() else B), 2)]:
        results = load_on(path, fulls, placement, sbp_of, world)
        for rank, got in enumerate(results):
            for k, v in fulls.items():
                full, _ = got[k]
                assert full.dtype == v.dtype and torch.equal(full, v), (k, placement, rank)

    plain = {k: torch.zeros_like(v) for k, v in fulls.items()}  # one process, no world
    dcp.load(plain, checkpoint_id=path)
    for k, v in fulls.items():
        assert torch.equal(plain[k], v), k


def test_partial_sums_are_reduced_when_saved_and_loaded_into_partial(tmp_path):
    path = str(tmp_path / "ckpt")
    fulls = {"p0": value((6, 4), torch.float64, 1), "p1": value((5, 3), torch.float32, 2),
             "p2": value((5,), torch.float64, 3), "p3": value((), torch.float32, 4)}
    sbps = {"p0": (P, S(0)), "p1": (S(1), P), "p2": (P, P), "p3": (P, B)}

    def save(rank):  # P pieces are unequal parts of the value (helpers.piece)
        state = {k: make_global(v, Layout(G22, sbps[k], v.shape), rank) for k, v in fulls.items()}
        before = {k: t.to_local().clone() for k, t in state.items()}
        dcp.save(state, checkpoint_id=path)
        return all(torch.equal(before[k], t.to_local()) for k, t in state.items())

    assert all(run_ranks(save, 4, timeout=TIMEOUT))  # the saved tensors keep their pieces
    meta = dcp.FileSystemReader(path).read_metadata()
    for k, v in fulls.items():  # summed with reduce_scatters: each rank wrote a part of the sum
        chunks = meta.state_dict_metadata[k].chunks
        assert sum(torch.Size(c.sizes).numel() for c in chunks) == v.numel(), k
    assert len(meta.state_dict_metadata["p0"].chunks) == 4
    for k, (full, _) in load_on(path, fulls, G2, lambda v: B, 2)[1].items():
        assert torch.allclose(full, fulls[k], atol=1e-6), k

    def load_partial(rank):
        state = {k: make_global(torch.ones_like(v), Layout(G2, P, v.shape), rank)
                 for k, v in fulls.items()}
        dcp.load(state, checkpoint_id=path)
        return {k: (t.full_tensor(), t.to_local()) for k, t in state.items()}

    results = run_ranks(load_partial, 2, timeout=TIMEOUT)
    for k, v in fulls.items():
        assert torch.allclose(results[0][k][0], v, atol=1e-6)
        assert torch.allclose(results[0][k][1], v, atol=1e-6)   # coordinate 0 holds the value
        assert not results[1][k][1].any()                       # the others hold zeros


def test_placements_leaving_ranks_out_and_empty_tensors(tmp_path):
    path = str(tmp_path / "ckpt")
    fulls = {"x": value((5, 4), torch.float32, 3), "e": value((0, 3), torch.float32),
             "s": value((), torch.int64, 4)}
    src = {"x": Layout(gt.placement("cpu", [3, 1]), S(0), (5, 4)),      # ranks 0 and 2 out
           "e": Layout(gt.placement("cpu", [[2, 0]]), (B, S(1)), (0, 3)),
           "s": Layout(gt.placement("cpu", [1]), B, ())}

    def save(rank):
        dcp.save({k: make_global(v, src[k], rank) for k, v in fulls.items()}, checkpoint_id=path)

    run_ranks(save, 4, timeout=TIMEOUT)
    dst = gt.placement("cpu", [2, 1])  # world of 3: rank 0 out

    def load(rank):
        state = {k: make_global(torch.zeros_like(v), Layout(dst, S(v.dim() - 1) if v.dim() else B,
                                                            v.shape), rank)
                 for k, v in fulls.items()}
        dcp.load(state, checkpoint_id=path)
        return {k: t.full_tensor() for k, t in state.items()}

    for got in run_ranks(load, 3, timeout=TIMEOUT):
        for k, v in fulls.items():
            assert torch.equal(got[k], v), k


def test_random_layouts_save_and_load_into_random_layouts(tmp_path):
    """Shuffled ranks, 1-3 placement axes, axes of size 1, empty dims, scalars, S / B / P."""
    cases = random_cases(seed=15, count=40, world=4)

    def body(rank):
        wrong = []
        for i, (src, dst) in enumerate(cases):
            full, path = full_of(src.shape), str(tmp_path / f"case{i}")
            dcp.save({"t": make_global(full, src, rank)}, checkpoint_id=path)
            state = {"t": make_global(torch.zeros_like(full), dst, rank)}
            dcp.load(state, checkpoint_id=path)
            if not torch.allclose(state["t"].full_tensor(), full, rtol=1e-5):
                wrong.append(f"{src} -> {dst}")
        return wrong

    assert run_ranks(body, 4, timeout=TIMEOUT)[0] == []


def test_each_rank_writes_only_what_it_owns(tmp_path):
    """A split tensor's elements are written once in all; a broadcast one once, not per rank."""
    path = str(tmp_path / "ckpt")
    split, bcast = value((256, 130), torch.float32, 5), value((200, 128), torch.float32, 6)

    def body(rank):
        dcp.save({"split": make_global(split, Layout(G22, (S(0), S(1)), split.shape), rank),
                  "bcast": make_global(bcast, Layout(G22, (B, B), bcast.shape), rank),
                  "mixed": make_global(split, Layout(G22, (B, S(0)), split.shape), rank)},
                 checkpoint_id=path)

    run_ranks(body, 4, timeout=TIMEOUT)
    meta = dcp.FileSystemReader(path).read_metadata()
    for key in ("split", "bcast", "mixed"):
        md = meta.state_dict_metadata[key]
        assert sum(torch.Size(c.sizes).numel() for c in md.chunks) == md.size.numel(), key
    logical = (2 * split.numel() + bcast.numel()) * 4
    data = sum(os.path.getsize(tmp_path / "ckpt" / f) for f in os.listdir(path) if f.endswith(".distcp"))
    assert logical <= data < logical * 1.05  # B written once: 2 copies would be 1.4x
    sizes = sorted(os.path.getsize(tmp_path / "ckpt" / f) for f in os.listdir(path)
                   if f.endswith(".distcp"))
    assert sizes[-1] < 0.45 * logical  # no rank wrote a whole tensor's share of the others


# ----------------------------------------------------------------- gt.checkpoint: training resume

STEPS, BATCH, IN, HIDDEN, OUT = 10, 16, 8, 12, 3


class MLP(torch.nn.Module):
    def __init__(self, in_=IN, hidden=HIDDEN, seed=0):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.w1 = torch.nn.Parameter(torch.randn(in_, hidden, generator=g) / in_ ** 0.5)
        self.w2 = torch.nn.Parameter(torch.randn(hidden, OUT, generator=g) / hidden ** 0.5)

    def forward(self, x):
        return torch.relu(x @ self.w1) @ self.w2


_g = torch.Generator().manual_seed(1)
X, Y = torch.randn(BATCH, IN, generator=_g), torch.randn(BATCH, OUT, generator=_g)


def tp_dp(name, t):
    """Quickstart's layout on a 2x2 grid: axis 0 data parallel, axis 1 tensor parallel."""
    return {"w1": (B, S(1)), "w2": (B, S(0))}[name]


def run_2x2(rank, steps, path=None):
    model = MLP().to_global(G22, tp_dp)
    opt = torch.optim.AdamW(model.parameters(), lr=0.02, weight_decay=0.1)
    x, y = (gt.tensor(t, placement=G22, sbp=(S(0), B)) for t in (X, Y))
    losses = train_mse(model, opt, x, y, steps)
    if path is not None:
        gt.checkpoint.save(path, model=model, optimizer=opt, extra={"step": steps, "note": "tp x dp"})
    return losses


def resume(rank, path, placement, sbp_fn, steps):
    model = MLP(seed=9).to_global(placement, sbp_fn)   # other values: all must come from the file
    opt = torch.optim.AdamW(model.parameters(), lr=0.5, weight_decay=0.1)
    extra = gt.checkpoint.load(path, model=model, optimizer=opt)
    sbp = (B,) * placement.ndim
    x, y = (gt.tensor(t, placement=placement, sbp=sbp) for t in (X, Y))
    state = opt.state[model.w1]
    layouts = (model.w1.sbp, state["exp_avg"].sbp, state["exp_avg_sq"].sbp, opt.param_groups[0]["lr"])
    return extra, layouts, train_mse(model, opt, x, y, steps)


def test_training_saved_after_5_steps_resumes_on_another_layout_with_the_same_losses(tmp_path):
    path = str(tmp_path / "step5")
    whole = run_ranks(run_2x2, 4, STEPS, timeout=TIMEOUT)[0]
    first = run_ranks(run_2x2, 4, 5, path, timeout=TIMEOUT)[0]
    assert first == whole[:5]
    extra, layouts, rest = run_ranks(resume, 2, path, G2, lambda n, t: S(0) if n == "w1" else S(1),
                                     5, timeout=TIMEOUT)[1]
    assert extra == {"step": 5, "note": "tp x dp"}
    assert layouts == ((S(0),), (S(0),), (S(0),), 0.02)  # optimizer state laid out as its param
    assert rest == pytest.approx(whole[5:], rel=1e-5, abs=1e-6)

    # in one process, plain tensors: the same model, the same continuation
    model = MLP(seed=9)
    opt = torch.optim.AdamW(model.parameters(), lr=0.5, weight_decay=0.1)
    assert gt.checkpoint.load(path, model=model, optimizer=opt)["step"] == 5
    assert train_mse(model, opt, X, Y, 5) == pytest.approx(whole[5:], rel=1e-5, abs=1e-6)


def test_one_plain_file_for_inference_with_dcp_to_torch_save(tmp_path):
    path = str(tmp_path / "ckpt")
    run_ranks(run_2x2, 4, 2, path, timeout=TIMEOUT)
    out = tmp_path / "model.pt"
    dcp_to_torch_save(path, out)
    saved = torch.load(out)
    model = MLP()
    model.load_state_dict(saved["model"])  # the trained weights, whole
    ref = MLP()
    opt = torch.optim.AdamW(ref.parameters(), lr=0.02, weight_decay=0.1)
    train_mse(ref, opt, X, Y, 2)
    assert torch.allclose(model.w1, ref.w1, atol=1e-6) and torch.allclose(model.w2, ref.w2, atol=1e-6)
    assert saved["extra"]["step"] == 2 and "exp_avg" in saved["optimizer"]["state"]["w1"]


# ------------------------------------------------------------------------------- bad input


def on_every_rank(world, fn, *args):
    """Run ``fn(rank, *args)`` on ``world`` ranks; each returns the GlobalTensorError message it
    raised (None if none) and what ``fn`` reports about the state it left."""
    def body(rank):
        try:
            out = fn(rank, *args)
        except GlobalTensorError as e:
            return str(e), None
        return None, out

    return run_ranks(body, world, timeout=TIMEOUT)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A training checkpoint of the 2x2 run after 2 steps."""
    path = str(tmp_path_factory.mktemp("ckpt") / "run")
    run_ranks(run_2x2, 4, 2, path, timeout=TIMEOUT)
    return path


def load_keeps(rank, path, model_fn=lambda: MLP(seed=9), with_optimizer=True):
    """Try a load on G2; report whether the model and a fresh optimizer were left as they were."""
    model = model_fn().to_global(G2, lambda n, t: S(0))
    before = {k: v.full_tensor().clone() for k, v in model.state_dict().items()}
    opt = torch.optim.AdamW(model.parameters(), lr=0.5) if with_optimizer else None
    try:
        gt.checkpoint.load(path(rank) if callable(path) else path, model=model, optimizer=opt)
    except GlobalTensorError:
        kept = all(torch.equal(before[k], v.full_tensor()) for k, v in model.state_dict().items())
        assert kept and (opt is None or not opt.state), "bad input changed the model or optimizer"
        raise
    return "loaded"


def copy_of(saved, tmp_path):
    import shutil
    path = str(tmp_path / "copy")
    shutil.copytree(saved, path)
    return path


def test_missing_directory_or_file_or_metadata_raise_on_every_rank(saved, tmp_path):
    assert on_every_rank(2, load_keeps, str(tmp_path / "nope"))[0][0].startswith(
        "gt.checkpoint.load: expected a checkpoint directory, found no ")
    open(tmp_path / "file", "w").close()
    assert "found a file" in on_every_rank(2, load_keeps, str(tmp_path / "file"))[1][0]

    partial = copy_of(saved, tmp_path)
    os.remove(os.path.join(partial, ".metadata"))  # as an interrupted save leaves it
    for message, _ in on_every_rank(2, load_keeps, partial):
        assert "found no .metadata (DCP writes it last" in message

    partial = copy_of(saved, tmp_path / "b")
    os.remove(os.path.join(partial, "__2_0.distcp"))
    for message, _ in on_every_rank(2, load_keeps, partial):
        assert "found __2_0.distcp missing or cut short" in message and "no such file" in message

    partial = copy_of(saved, tmp_path / "c")
    name = os.path.join(partial, "__1_0.distcp")
    os.truncate(name, os.path.getsize(name) // 2)
    for message, _ in on_every_rank(2, load_keeps, partial):
        assert "__1_0.distcp missing or cut short (expected at least" in message


def test_a_problem_one_rank_alone_sees_raises_on_every_rank(saved, tmp_path):
    results = on_every_rank(2, load_keeps, lambda rank: saved if rank == 0 else str(tmp_path / "x"))
    for message, _ in results:
        assert message.startswith("gt.checkpoint.load: expected a checkpoint directory, found no ")
        assert message.endswith("(on rank 1)")


def test_a_failed_load_leaves_partial_pieces_as_they_were(saved, tmp_path):
    """Loading into a P tensor zeroes the pieces off coordinate 0, but only once every rank's
    plan is made: here rank 0 alone sees a bad path, and rank 1's piece is kept."""
    def body(rank, where):
        model = MLP(seed=9).to_global(G2, lambda n, t: B)
        w1 = model.w1.full_tensor()
        model.w1 = torch.nn.Parameter(make_global(w1, Layout(G2, P, w1.shape), rank))  # 2 parts
        before = model.w1.to_local().clone()
        assert before.abs().sum() > 0
        try:
            gt.checkpoint.load(where(rank), model=model)
        except GlobalTensorError as e:
            return str(e), torch.equal(before, model.w1.to_local())
        return None, model.w1.full_tensor()

    bad = run_ranks(body, 2, lambda rank: str(tmp_path / "x") if rank == 0 else saved,
                    timeout=TIMEOUT)
    assert [(m.endswith("(on rank 0)"), kept) for m, kept in bad] == [(True, True)] * 2
    good = run_ranks(body, 2, lambda rank: saved, timeout=TIMEOUT)
    w1 = MLP()
    gt.checkpoint.load(saved, model=w1)
    assert good[0][0] is None and torch.equal(good[0][1], w1.w1) and torch.equal(good[1][1], w1.w1)


def test_shapes_or_keys_that_differ_raise_on_every_rank_and_change_nothing(saved):
    for message, _ in on_every_rank(2, load_keeps, saved, lambda: MLP(hidden=10, seed=9)):
        assert "found 6 shape(s) that differ (model.w1: saved [8, 12], here [8, 10]; model.w2: " in message
        assert "nothing was loaded" in message

    class Wider(MLP):
        def __init__(self, seed=0):
            super().__init__(seed=seed)
            self.bias = torch.nn.Parameter(torch.zeros(OUT))

    for message, _ in on_every_rank(2, load_keeps, saved, Wider):
        assert "4 key(s) the checkpoint lacks (model.bias; optimizer.state.bias.step; " in message

    def fewer(rank):  # a checkpoint of the model alone, loaded with an optimizer
        model = MLP().to_global(G2, lambda n, t: B)
        gt.checkpoint.save(saved + "-model", model=model)
        return load_keeps(rank, saved + "-model")

    for message, _ in on_every_rank(2, fewer):
        assert "key(s) the checkpoint lacks (optimizer." in message, message
    # and the other way: the training checkpoint into the model alone is fine
    assert on_every_rank(2, load_keeps, saved, MLP, False) == [(None, "loaded")] * 2


def test_save_replaces_a_checkpoint_whole_and_never_a_directory_of_other_files(saved, tmp_path):
    other = tmp_path / "mine"
    other.mkdir()
    (other / "notes.txt").write_text("keep me")

    def save(rank, path, seed):
        gt.checkpoint.save(path, model=MLP(seed=seed).to_global(G2, lambda n, t: S(1)))
        return sorted(os.listdir(os.path.dirname(path)))

    for message, _ in on_every_rank(2, save, str(other), 3):
        assert "found a directory of other files (no .metadata)" in message
    assert (other / "notes.txt").read_text() == "keep me" and os.listdir(other) == ["notes.txt"]

    path = str(tmp_path / "ckpt")
    on_every_rank(2, save, path, 3)
    # an interrupted save: a staging directory of partial files, a replaced one not yet deleted
    os.makedirs(path + ".saving")
    (tmp_path / "ckpt.saving" / "__0_0.distcp").write_bytes(b"partial")
    os.makedirs(path + ".replaced-0123")
    model = MLP(seed=0)
    gt.checkpoint.load(path, model=model)  # the checkpoint at path is whole
    assert torch.equal(model.w1, MLP(seed=3).w1)

    assert on_every_rank(2, save, path, 4)[0][0] is None
    for t in threading.enumerate():  # the replaced checkpoint is deleted in the background
        if t.name == "gt-checkpoint-delete":
            t.join(10)
    assert sorted(os.listdir(tmp_path)) == ["ckpt", "mine"]
    gt.checkpoint.load(path, model=model)
    assert torch.equal(model.w1, MLP(seed=4).w1)


def test_bad_arguments_raise_before_any_communication(tmp_path):
    with pytest.raises(GlobalTensorError, match="expected model= to be a torch.nn.Module"):
        gt.checkpoint.save(str(tmp_path), model={"w": torch.ones(2)})
    with pytest.raises(GlobalTensorError, match="found optimizer= without model="):
        gt.checkpoint.load(str(tmp_path), optimizer=torch.optim.SGD([torch.ones(1)], lr=1))
    with pytest.raises(GlobalTensorError, match="expected extra= to be a dict"):
        gt.checkpoint.save(str(tmp_path), model=MLP(), extra=5)
    with pytest.raises(GlobalTensorError, match="expected a directory path"):
        gt.checkpoint.load(5, model=MLP())


def test_saved_in_one_process_loads_on_ranks(tmp_path):
    """A plain model saved with no world at all, loaded into global tensors on a 2x2 grid."""
    path = str(tmp_path / "plain")
    model = MLP(seed=5)
    gt.checkpoint.save(path, model=model, extra={"epoch": 3})
    with pytest.raises(GlobalTensorError, match="found a file"):  # in one process too
        gt.checkpoint.save(str(tmp_path / "plain" / ".metadata"), model=model)

    def body(rank, where):
        m = MLP(seed=0).to_global(G22, tp_dp)
        extra = gt.checkpoint.load(where, model=m)
        return extra, m.w1.full_tensor(), m.w2.full_tensor()

    extra, w1, w2 = run_ranks(body, 4, path, timeout=TIMEOUT)[3]
    assert extra == {"epoch": 3} and torch.equal(w1, model.w1) and torch.equal(w2, model.w2)

    # and from one plain file (pretrained weights): DCP's torch_save_to_dcp, then any layout
    torch.save({"model": MLP(seed=6).state_dict()}, tmp_path / "weights.pt")
    torch_save_to_dcp(tmp_path / "weights.pt", tmp_path / "from-file")
    extra, w1, w2 = run_ranks(body, 4, str(tmp_path / "from-file"), timeout=TIMEOUT)[0]
    assert extra == {} and torch.equal(w1, MLP(seed=6).w1) and torch.equal(w2, MLP(seed=6).w2)


def test_hooks_in_a_thread_with_no_world_refuse_instead_of_guessing_the_rank():
    """dcp.async_save plans in a thread of its own; inside run_ranks (one world per thread)
    that thread has no world, and the hooks must not describe rank 0's piece for every rank."""
    def body(rank):
        x = make_global(full_of((4, 3)), Layout(G2, S(0), (4, 3)), rank)
        found = []
        t = threading.Thread(target=lambda: found.append(error_or_none(x.__create_chunk_list__)))
        t.start()
        t.join(10)
        return found, x.__create_chunk_list__()[0].offsets  # in its own thread: fine

    for rank, (found, offsets) in enumerate(run_ranks(body, 2, timeout=TIMEOUT)):
        assert found[0][0] == "GlobalTensorError" and "its rank is unknown" in found[0][1]
        assert tuple(offsets) == (2 * rank, 0)
