"""gt.data.loader: global batches whose sequence depends on the seed only (not the world size or
layout), each rank reading only the samples of its piece, and resuming mid-epoch on any world."""
import threading

import pytest
import torch

import globaltensor as gt
from globaltensor.errors import GlobalTensorError
from globaltensor.testing import run_ranks

S, B, P = gt.sbp.S, gt.sbp.B, gt.sbp.P
TIMEOUT = 60


class Numbers(torch.utils.data.Dataset):
    """Sample i: ({"x": [i, 10 i, 100 i]}, label i); records which rank read which sample."""

    def __init__(self, n):
        self.n = n
        self.reads: dict[int, list[int]] = {}
        self.lock = threading.Lock()

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        with self.lock:
            self.reads.setdefault(gt.env.get_rank(), []).append(i)
        return {"x": torch.tensor([i, 10 * i, 100 * i], dtype=torch.float32)}, i


def full_batches(loader, epochs=1):
    """Every batch as (full x, full labels, sbp of x), for ``epochs`` epochs."""
    out = []
    for _ in range(epochs):
        for features, labels in loader:
            out.append((features["x"].full_tensor(), labels.full_tensor(), features["x"].sbp))
    return out


def one_process(n, batch_size, epochs=1, **kw):
    def body(rank):
        p = gt.placement("cpu", [0])
        return full_batches(gt.data.loader(Numbers(n), p, batch_size, **kw), epochs)
    return run_ranks(body, 1, timeout=TIMEOUT)[0]


def same(a, b):
    assert len(a) == len(b)
    for (xa, ya, _), (xb, yb, _) in zip(a, b):
        assert torch.equal(xa, xb) and torch.equal(ya, yb)


LAYOUTS = {
    "4 ranks S(0)": (4, lambda: gt.placement("cpu", [0, 1, 2, 3]), None, (S(0),)),
    "3 ranks S(0), uneven": (3, lambda: gt.placement("cpu", [0, 1, 2]), S(0), (S(0),)),
    "2x2 (S(0), S(0))": (4, lambda: gt.placement("cpu", [[0, 1], [2, 3]]), None, (S(0), S(0))),
    "2x2 named dp": (4, lambda: gt.placement("cpu", [[0, 1], [2, 3]], axes=("dp", "tp")),
                     {"dp": S(0)}, (S(0), B)),
    "2 ranks of 3": (3, lambda: gt.placement("cpu", [2, 0]), S(0), (S(0),)),
}


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_batches_match_one_process_and_ranks_read_their_piece(name):
    world, make_placement, sbp, expected_sbp = LAYOUTS[name]
    reference = one_process(10, 4, epochs=2, seed=3)
    dataset = Numbers(10)

    def body(rank):
        p = make_placement()
        loader = gt.data.loader(dataset, p, batch_size=4, sbp=sbp, seed=3)
        assert len(loader) == 3
        return full_batches(loader, epochs=2)
    results = run_ranks(body, world, timeout=TIMEOUT)
    for got in results:
        same(got, reference)
        assert all(s == expected_sbp for _, _, s in got)
    # every sample of every batch is read by the ranks of its piece only (a rank with an empty
    # piece reads the batch's first sample, for the dtypes and sample shapes)
    p = make_placement()
    read_by = {r: sorted(dataset.reads.get(r, [])) for r in range(world)}
    expected = {r: [] for r in range(world)}
    for x, _, _ in reference:
        layout = gt.Layout(p, expected_sbp, (x.shape[0],))
        for coord in p.coords():
            a, b = layout.box(coord)[0]
            rows = x[a:b, 0].long().tolist() if b > a else x[:1, 0].long().tolist()
            expected[p.rank_at(coord)] += rows
        for r in set(range(world)) - set(p.flat_ranks):  # the dtypes of its empty piece
            expected[r] += x[:1, 0].long().tolist()
    assert read_by == {r: sorted(v) for r, v in expected.items()}


def test_order_is_a_seeded_permutation_and_differs_per_epoch():
    batches = one_process(12, 5, epochs=2, seed=0)
    first = torch.cat([y for _, y, _ in batches[:3]]).tolist()
    second = torch.cat([y for _, y, _ in batches[3:]]).tolist()
    assert sorted(first) == sorted(second) == list(range(12)) and first != second
    assert first == torch.randperm(12, generator=torch.Generator().manual_seed(0)).tolist()
    assert [len(y) for _, y, _ in batches] == [5, 5, 2, 5, 5, 2]
    plain = one_process(12, 5, shuffle=False, drop_last=True)
    assert [y.tolist() for _, y, _ in plain] == [[0, 1, 2, 3, 4], [5, 6, 7, 8, 9]]


def test_resume_mid_epoch_on_another_world_size():
    reference = one_process(11, 3, epochs=2, seed=5)  # 4 batches per epoch

    def first_part(rank):
        loader = gt.data.loader(Numbers(11), gt.placement("cpu", [0, 1, 2, 3]), 3, seed=5)
        it = iter(loader)
        seen = [next(it) for _ in range(2)]
        return [(f["x"].full_tensor(), y.full_tensor(), f["x"].sbp) for f, y in seen], \
            loader.state_dict()
    seen, state = run_ranks(first_part, 4, timeout=TIMEOUT)[0]
    assert state["epoch"] == 0 and state["batch"] == 2

    def rest(rank):
        loader = gt.data.loader(Numbers(11), gt.placement("cpu", [0, 1]), 3, seed=5)
        loader.load_state_dict(state)
        return full_batches(loader, epochs=2)
    got = run_ranks(rest, 2, timeout=TIMEOUT)
    same(seen + got[0], reference)
    same(got[1], got[0])


def test_split_of_a_feature_dim():
    def body(rank):
        loader = gt.data.loader(Numbers(4), gt.placement("cpu", [0, 1]), 4, sbp=S(1),
                                shuffle=False)
        features, labels = next(iter(loader))
        return features["x"].sbp, features["x"].to_local(), labels.sbp, labels.to_local()
    (s0, x0, l0, y0), (s1, x1, _, y1) = run_ranks(body, 2, timeout=TIMEOUT)
    assert s0 == (S(1),) and x0.tolist() == [[0, 0], [1, 10], [2, 20], [3, 30]]
    assert x1.tolist() == [[0], [100], [200], [300]]
    assert l0 == (B,) and y0.tolist() == y1.tolist() == [0, 1, 2, 3]  # 1-D labels: no dim 1


def test_bad_input_is_a_clear_error():
    p = gt.placement("cpu", [0])

    def body(rank):
        messages = []
        for kwargs in ({"batch_size": 0}, {"batch_size": 2, "sbp": P},
                       {"batch_size": 2, "sbp": {"tp": S(0)}}):
            with pytest.raises(GlobalTensorError) as e:
                gt.data.loader(Numbers(4), p, **kwargs)
            messages.append(str(e.value))
        loader = gt.data.loader(Numbers(4), p, 2, seed=1)
        with pytest.raises(GlobalTensorError) as e:
            loader.load_state_dict({"epoch": 0, "batch": 1, "seed": 2})
        return messages + [str(e.value)]
    size, partial, name, state = run_ranks(body, 1, timeout=TIMEOUT)[0]
    assert "positive int batch_size" in size and "found 0" in size
    assert "no partial sum" in partial and "(P,)" in partial
    assert "'tp'" in name and "unnamed" in name
    assert "seed=2" in state and "seed=1" in state


class Stream(torch.utils.data.IterableDataset):
    def __iter__(self):
        return iter(range(4))


def test_input_it_would_silently_misread_is_a_clear_error_on_every_rank():
    """Issue 41: S(3) on 2-D samples gave every batch whole, shuffle="no" shuffled, an iterable
    dataset raised a raw TypeError."""
    def body(rank):
        p = gt.placement("cpu", [0, 1])
        messages = []
        for dataset, kwargs in ((Numbers(4), {"shuffle": "no"}), (Numbers(4), {"drop_last": 1}),
                                (Stream(), {}), (iter([1, 2]), {})):
            with pytest.raises(GlobalTensorError) as e:
                gt.data.loader(dataset, p, 2, **kwargs)
            messages.append(str(e.value))
        matrices = torch.utils.data.TensorDataset(torch.zeros(4, 2, 5), torch.arange(4))
        loader = gt.data.loader(matrices, p, 2, sbp=S(3))
        with pytest.raises(GlobalTensorError) as e:
            next(iter(loader))
        return messages + [str(e.value)]
    results = run_ranks(body, 2, timeout=TIMEOUT)
    assert results[0] == results[1]  # the same error on every rank
    shuffle, drop_last, stream, generator, split = results[0]
    assert "expected shuffle=True or shuffle=False, found shuffle='no' (str)" in shuffle
    assert "found drop_last=1 (int)" in drop_last
    assert "expected a map-style dataset (__len__ and __getitem__" in stream
    assert "found Stream, an IterableDataset" in stream and "list(samples)" in stream
    assert "found list_iterator, no __len__ and __getitem__" in generator
    assert "splits dim 3 on placement axis 0" in split and "at most 3 dims" in split
    assert "[[2, 2, 5], [2]]" in split and "Pick a dim below 3" in split


class Tokens(torch.utils.data.Dataset):
    """Sample i: ids and labels of length 12, the labels after position 4 + i % 5 ignored."""

    def __init__(self, n):
        g = torch.Generator().manual_seed(5)
        self.ids = torch.randint(0, 64, (n, 12), generator=g)
        self.labels = self.ids.clone()
        for i in range(n):
            self.labels[i, 4 + i % 5:] = -100

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return self.ids[i], self.labels[i]


def test_items_give_the_mean_its_count_without_a_collective_in_the_forward():
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    base = transformers.GPT2LMHeadModel(transformers.GPT2Config(
        vocab_size=64, n_embd=32, n_layer=1, n_head=4, n_positions=16, resid_pdrop=0.0,
        embd_pdrop=0.0, attn_pdrop=0.0, attn_implementation="sdpa"))
    data = Tokens(12)
    shifted = lambda i: int((data.labels[i][1:] != -100).sum())  # what HF's causal loss counts
    ref = __import__("copy").deepcopy(base)
    ids, labels = next(iter(torch.utils.data.DataLoader(
        data, batch_size=6, sampler=gt.data.sample_order(12, True, 0, 0))))
    want = ref(ids, labels=labels).loss
    want.backward()

    def body(rank):
        model = __import__("copy").deepcopy(base).to_global(gt.placement("cpu", [0, 1, 2]), B)
        loader = gt.data.loader(data, gt.placement("cpu", [0, 1, 2]), 6, seed=0, items=shifted)
        x, y = next(iter(loader))
        with gt.comm_trace() as given:
            loss = model(x, labels=y, num_items_in_batch=loader.num_items).loss
        with gt.comm_trace() as counted:
            counted_loss = model(x, labels=y).loss
        loss.backward()
        grads = {n: p.grad.full_tensor() for n, p in model.named_parameters()}
        return (loader.num_items, given.counts(), counted.counts(), loss.sbp, loss.item(),
                counted_loss.item(), grads)

    for num_items, given, counted, sbp, value, plain, grads in run_ranks(body, 3, timeout=TIMEOUT):
        assert num_items == sum(shifted(i) for i in gt.data.sample_order(12, True, 0, 0)[:6])
        assert given == {} and counted == {"all_reduce": 1}
        assert sbp == (P,)
        assert value == pytest.approx(want.item(), rel=1e-6) and plain == pytest.approx(value, rel=1e-6)
        for n, p in ref.named_parameters():
            assert torch.allclose(grads[n], p.grad, rtol=1e-5, atol=1e-7), n


def test_items_must_be_a_function_giving_counts():
    def body(rank):
        p = gt.placement("cpu", [0, 1])
        with pytest.raises(GlobalTensorError, match="expected items= to be a function"):
            gt.data.loader(Numbers(4), p, 2, items=3)
        loader = gt.data.loader(Numbers(4), p, 2, items=lambda i: -1 if i == 2 else 1, shuffle=False)
        it = iter(loader)
        next(it)
        assert loader.num_items == 2
        with pytest.raises(GlobalTensorError, match=r"expected items\(2\) to be an int >= 0"):
            next(it)
        return True
    assert run_ranks(body, 2, timeout=TIMEOUT) == [True, True]
