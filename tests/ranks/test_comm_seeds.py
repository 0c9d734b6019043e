"""The examples of the seed documents, run with gt.comm, reproducing what they print.

000 Lightning Fabric collectives guide, 001 PyTorch-Ignite collectives tutorial, 003 OneFlow
distributed reference (DDP example, comm names), 004 barrier ablation. Ranks are threads, so
"print" appends to a shared, locked log; sleeps are scaled down (they only shuffle arrival order).
"""
import threading
import time

import pytest
import torch
from torch.nn.parallel import DistributedDataParallel as TorchDDP

import globaltensor as gt
from globaltensor.nn.parallel import DistributedDataParallel as ddp
from globaltensor.testing import run_ranks

T = 60


class Log:
    """What the ranks printed, in the order they printed it."""

    def __init__(self):
        self.lines, self._lock = [], threading.Lock()

    def after(self, word):
        """The lines containing ``word``, sorted (ranks print in any order)."""
        return sorted(line for line in self.lines if word in line)

    def print(self, *parts):
        with self._lock:
            self.lines.append(" ".join(str(p) for p in parts))

    def index(self, line):
        return self.lines.index(line)


# ----------------------------------------------------------------------------- 000: Fabric


def test_fabric_barrier_waits_for_the_slowest_process():
    log = Log()

    def body(rank):
        time.sleep(0.02 * rank)  # "simulate each process taking a different amount of time"
        log.print(f"Process {rank} is done.")
        gt.comm.barrier()
        log.print("All processes reached the barrier!")

    run_ranks(body, 4, timeout=T)
    done = max(log.index(f"Process {r} is done.") for r in range(4))
    assert done == 3 and log.lines[4:] == ["All processes reached the barrier!"] * 4


def test_fabric_download_then_barrier(tmp_path):
    log = Log()

    def body(rank):
        if rank == 0:
            log.print("Downloading dataset. This can take a while ...")
            time.sleep(0.03)
            (tmp_path / "data.txt").write_text("1 2 3")
        gt.comm.barrier()  # all other processes wait here until rank 0 is done downloading
        return (tmp_path / "data.txt").read_text()

    assert run_ranks(body, 4, timeout=T) == ["1 2 3"] * 4


def test_fabric_rank_zero_first_downloads_once(tmp_path):
    downloads = Log()

    def body(rank):
        with gt.comm.rank_zero_first():
            if not (tmp_path / "data.txt").exists():
                downloads.print(f"rank {rank} downloads")
                time.sleep(0.03)
                (tmp_path / "data.txt").write_text("dataset")
            return (tmp_path / "data.txt").read_text()

    assert run_ranks(body, 4, timeout=T) == ["dataset"] * 4
    assert downloads.lines == ["rank 0 downloads"]


def test_fabric_broadcast_learning_rate():
    def body(rank):
        learning_rate = torch.rand(1, generator=torch.Generator().manual_seed(rank))
        before = learning_rate.clone()
        learning_rate = gt.comm.broadcast(learning_rate)          # the source is rank 0
        from_three = gt.comm.broadcast(before.clone(), src=3)     # ... or any other rank
        return before, learning_rate, from_three

    out = run_ranks(body, 4, timeout=T)
    assert len({o[0].item() for o in out}) == 4                  # different on each process
    assert all(torch.equal(o[1], out[0][0]) for o in out)        # rank 0's value everywhere
    assert all(torch.equal(o[2], out[3][0]) for o in out)


def test_fabric_all_gather_stacks():
    log = Log()

    def body(rank):
        data = torch.tensor(10 * rank)
        result = gt.comm.all_gather(data)
        log.print("Result of all-gather:", result)
        with torch.no_grad():
            collection = {"loss": torch.tensor(float(rank)), "data": torch.ones(2) * rank}
            return gt.comm.all_gather(collection)

    out = run_ranks(body, 4, timeout=T)
    assert log.lines == ["Result of all-gather: tensor([ 0, 10, 20, 30])"] * 4
    assert out[0]["loss"].tolist() == [0.0, 1.0, 2.0, 3.0] and out[0]["data"].shape == (4, 2)


def test_fabric_all_reduce_sum_and_mean_of_a_collection():
    log = Log()

    def body(rank):
        data = torch.tensor(10 * rank)
        result = gt.comm.all_reduce(data, reduce_op="sum")
        log.print("Result of all-reduce:", result)
        collection = {"loss": torch.tensor(1.0 + rank), "data": [torch.ones(2) * rank, 2.0 * rank]}
        return gt.comm.all_reduce(collection, reduce_op="mean"), data

    out = run_ranks(body, 4, timeout=T)
    assert log.lines == ["Result of all-reduce: tensor(60)"] * 4  # sum(0 + 10 + 20 + 30)
    mean, data = out[2]
    assert mean["loss"].item() == 2.5 and mean["data"][0].tolist() == [1.5, 1.5]
    assert mean["data"][1] == 3.0 and data.item() == 20  # the caller's tensor is untouched


# ----------------------------------------------------------------------------- 001: Ignite


def test_ignite_all_reduce_in_place():
    log = Log()

    def all_reduce_example(local_rank):
        tensor = torch.arange(2, dtype=torch.int64) + 1 + 2 * local_rank
        log.print(f"Rank {local_rank}, Initial value: {tensor}")
        gt.comm.all_reduce(tensor, op="SUM")
        log.print(f"Rank {local_rank}, After performing all_reduce: {tensor}")

    run_ranks(all_reduce_example, 3, timeout=T)
    assert {f"Rank {r}, Initial value: {v}" for r, v in
            [(0, "tensor([1, 2])"), (1, "tensor([3, 4])"), (2, "tensor([5, 6])")]} <= set(log.lines)
    assert log.after("After") == [f"Rank {r}, After performing all_reduce: tensor([ 9, 12])"
                                     for r in range(3)]


def test_ignite_average_gradients():
    def grads_for(rank, model):
        model.zero_grad()
        x = torch.arange(6.0).view(2, 3) * (rank + 1)
        model(x).pow(2).sum().backward()
        return [p.grad.clone() for p in model.parameters()]

    def make():
        model = torch.nn.Linear(3, 2)
        with torch.no_grad():
            model.weight.copy_(torch.arange(6.0).view(2, 3) / 10)
            model.bias.fill_(0.5)
        return model

    def average_gradients(model):
        num_processes = gt.env.get_world_size()
        for param in model.parameters():
            gt.comm.all_reduce(param.grad.data, op="SUM")
            param.grad.data = param.grad.data / num_processes

    def body(rank):
        model = make()
        grads_for(rank, model)
        average_gradients(model)
        return [p.grad for p in model.parameters()]

    out = run_ranks(body, 3, timeout=T)
    per_rank = [grads_for(r, make()) for r in range(3)]
    for k in range(2):
        want = sum(g[k] for g in per_rank) / 3
        assert all(torch.allclose(o[k], want) for o in out)


def test_ignite_all_gather_numbers():
    log = Log()

    def all_gather_example(local_rank):
        num = 2.0 * gt.env.get_rank()
        log.print(f"Rank {local_rank}, Initial value: {num}")
        all_nums = gt.comm.all_gather(num)
        log.print(f"Rank {local_rank}, After performing all_gather: {all_nums}")

    run_ranks(all_gather_example, 3, timeout=T)
    assert log.after("After") == [f"Rank {r}, After performing all_gather: [0.0, 2.0, 4.0]"
                                     for r in range(3)]
    assert "Rank 2, Initial value: 4.0" in log.lines


def test_ignite_write_predictions_on_rank_zero(tmp_path):
    def write_preds_to_file(predictions, filename):
        prediction_tensor = torch.tensor(predictions)
        prediction_tensor = gt.comm.all_gather(prediction_tensor)
        if gt.env.get_rank() == 0:
            torch.save(prediction_tensor, filename)

    run_ranks(lambda r: write_preds_to_file([r, r + 0.5], tmp_path / "preds.pt"), 3, timeout=T)
    # stacked on a new dim 0, one row per rank (Ignite concatenates; see docs/collectives.md)
    assert torch.load(tmp_path / "preds.pt").tolist() == [[0, 0.5], [1, 1.5], [2, 2.5]]


def test_ignite_broadcast_a_string():
    log = Log()

    def broadcast_example(local_rank):
        message = f"hello from rank {gt.env.get_rank()}"
        log.print(f"Rank {local_rank}, Initial value: {message}")
        message = gt.comm.broadcast(message, src=0)
        log.print(f"Rank {local_rank}, After performing broadcast: {message}")

    run_ranks(broadcast_example, 3, timeout=T)
    assert log.after("After") == [f"Rank {r}, After performing broadcast: hello from rank 0"
                                     for r in range(3)]


def test_ignite_compute_metric_on_rank_zero_and_broadcast():
    def compute_fn(pred, target):
        return (pred.argmax(-1) == target).float().mean().item()

    def compute_metric(prediction_tensor, target_tensor):
        prediction_tensor = gt.comm.all_gather(prediction_tensor)
        target_tensor = gt.comm.all_gather(target_tensor)
        result = 0.0
        if gt.env.get_rank() == 0:
            result = compute_fn(prediction_tensor, target_tensor)
        return gt.comm.broadcast(result, src=0)

    def body(rank):
        pred = torch.tensor([[1.0, 0.0], [0.0, 1.0]]) if rank % 2 else torch.tensor([[0.0, 1.0]] * 2)
        return compute_metric(pred, torch.tensor([0, 1]))

    out = run_ranks(body, 3, timeout=T)
    assert out[0] == pytest.approx(4 / 6) and out == [out[0]] * 3  # ranks 0, 2 half right, 1 all


def test_ignite_local_rank_zero_prepares_datasets_first():
    log = Log()

    def get_datasets(rank):
        if gt.env.get_local_rank() > 0:
            gt.comm.barrier()
        log.print(f"rank {rank} builds datasets")
        time.sleep(0.01)
        if gt.env.get_local_rank() == 0:
            gt.comm.barrier()

    run_ranks(get_datasets, 3, timeout=T)
    assert log.lines[0] == "rank 0 builds datasets" and len(log.lines) == 3


# ----------------------------------------------------------------------------- 003: OneFlow


def test_oneflow_comm_names_exist_and_take_torch_arguments():
    names = ("all_reduce all_gather all_gather_into_tensor all_to_all broadcast barrier gather "
             "reduce reduce_scatter reduce_scatter_tensor recv scatter send").split()
    assert all(callable(getattr(gt.comm, n)) for n in names)

    def body(rank):
        t = torch.tensor([1.0 + rank])
        gt.comm.all_reduce(t, op=gt.comm.ReduceOp.SUM, group=None, async_op=False)
        return t.item()

    assert run_ranks(body, 2, timeout=T) == [3.0, 3.0]


def oneflow_ddp_example(rank, wrap, iterations=500):
    """The OneFlow DDP script, in torch (cuda -> cpu): returns what it printed and w."""
    train_x = [torch.tensor([[1, 2], [2, 3]], dtype=torch.float32),
               torch.tensor([[4, 6], [3, 1]], dtype=torch.float32)]
    train_y = [torch.tensor([[8], [13]], dtype=torch.float32),
               torch.tensor([[26], [9]], dtype=torch.float32)]

    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lr = 0.01
            self.iter_count = iterations
            self.w = torch.nn.Parameter(torch.tensor([[0], [0]], dtype=torch.float32))

        def forward(self, x):
            return torch.matmul(x, self.w)

    m = wrap(Model())
    loss = torch.nn.MSELoss(reduction="sum")
    lr, iter_count = (m.lr, m.iter_count) if wrap is ddp else (m.module.lr, m.module.iter_count)
    optimizer = torch.optim.SGD(m.parameters(), lr)
    printed = []
    for i in range(iter_count):
        x, y = train_x[rank], train_y[rank]
        l = loss(m(x), y)
        if (i + 1) % 50 == 0:
            printed.append(f"{i + 1}/{iter_count} loss:{l}")
        optimizer.zero_grad()
        l.backward()
        optimizer.step()
    w = m.w if wrap is ddp else m.module.w
    return printed, w.detach().clone()


def test_oneflow_ddp_example_learns_w_as_torch_ddp_does():
    def body(rank):
        assert gt.env.get_rank() == rank
        return oneflow_ddp_example(rank, ddp), oneflow_ddp_example(rank, TorchDDP)

    out = run_ranks(body, 2, timeout=T)
    (printed, w), (torch_printed, torch_w) = out[0]
    # both ranks' data fit w = [[2], [3]] exactly: averaged gradients must find it
    torch.testing.assert_close(w, torch.tensor([[2.0], [3.0]]), rtol=0, atol=1e-4)
    assert torch.allclose(w, torch_w, rtol=0, atol=1e-6) and torch.equal(w, out[1][0][1])
    assert len(printed) == 10 and printed[0].startswith("50/500 loss:")
    assert [p.split(":")[0] for p in printed] == [p.split(":")[0] for p in torch_printed]
    assert printed[-1].startswith("500/500 loss:")  # a 0-d tensor formats as its number
    assert float(printed[-1].split("loss:")[1]) < 1e-4


# ----------------------------------------------------------------------------- 004: ablation


def test_barrier_ablation_orders_messages():
    log = Log()

    def run_with_barrier(rank):
        results = []
        time.sleep(0.01 * (3 - rank))  # processes start at different times
        log.print("I HAVE BARRIER DUDE! WAITING FOR ALL PROCESSES TO SYNCHRONIZE...")
        gt.comm.barrier()
        results.append([1, 2, 3])
        log.print(f"Results: {results}")

    run_ranks(run_with_barrier, 4, timeout=T)
    assert log.lines == (["I HAVE BARRIER DUDE! WAITING FOR ALL PROCESSES TO SYNCHRONIZE..."] * 4
                         + ["Results: [[1, 2, 3]]"] * 4)
