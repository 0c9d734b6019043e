"""``gt.nn.Pipeline``: stages on disjoint placements, micro-batches run by a schedule
(SPEC "Pipelines"; docs/pipeline.md).

A stage is a module whose parameters the user laid out on one placement (any layout inside it).
Each rank runs only its own stages' tasks, in the order :mod:`.schedules` gives its placement;
inside a stage the ranks of its placement run SPMD as everywhere else. An activation leaves a
stage by the point-to-point moves of the plan between the two placements (runtime/stage_p2p.py),
posted without waiting, and enters the next stage as a leaf that requires grad; its gradient
goes back the same way, and a stage's backward is ``torch.autograd.backward(outputs, grads)``.
The receiving ranks learn the layouts of a stage's outputs once per input shape (a small message
from the sending stage). The data-parallel reduction of the parameters' gradients inside a stage
runs once per step, after the last micro-batch (grads.deferred_reduction). Every group of every
stage's placement is made up front by every rank; while the schedule runs no new group may be
made (runtime/groups.no_new_groups), so a stage that strays off its placement gets an error,
not a hang.
"""
from __future__ import annotations

import warnings
from typing import Callable

import torch

from ..errors import GlobalTensorError
from ..grads import deferred_reduction, reduce_gradients
from ..layout import Layout, box_numel, split_sizes
from ..placement import Placement
from ..plan import exchange
from ..runtime import failure
from ..runtime.groups import create_placement_groups, no_new_groups
from ..runtime.meta import object_from
from ..runtime import wire
from ..runtime.stage_p2p import (Incoming, Outgoing, object_bytes, recv_object, send_object,
                                 send_piece)
from ..sbp import replicated
from ..tensor import GlobalTensor, redistribute
from ..world import world
from ..world.simulated import simulated
from . import schedules
from .stages import (blank, check_disjoint, checked_inputs, empty_piece, placement_of,
                     sbp_on, sent_sbp, split_batch, tensors_of)
from .schedules import Task

__all__ = ["Pipeline"]

_META, _ACTIVATION, _GRADIENT = range(3)


class Pipeline:
    """Stages laid out on disjoint placements, run micro-batch by micro-batch::

        pipe = gt.nn.Pipeline([stage0, stage1], microbatches=8, schedule="1f1b")
        loss = pipe.step(x, target=y, loss_fn=F.cross_entropy)   # forward + backward
        opt.step()
        out = pipe(x)                                            # forward only

    ``schedule``: ``"gpipe"``, ``"1f1b"`` or ``"interleaved-1f1b"`` (more stages than
    placements; stage i on placement i % k). Every rank of the world builds the same Pipeline.
    """

    def __init__(self, stages, microbatches: int, schedule: str = "1f1b"):
        stages = list(stages) if isinstance(stages, (list, tuple, torch.nn.ModuleList)) else None
        if not stages or not all(isinstance(s, torch.nn.Module) for s in stages):
            raise GlobalTensorError(
                "expected stages to be a non-empty list of modules laid out with "
                "stage.to_global(placement, sbp_fn), e.g. gt.nn.Pipeline([stage0, stage1], "
                "microbatches=8)")
        self.stages = stages
        self.placements = [placement_of(s, i) for i, s in enumerate(stages)]
        distinct: list[Placement] = []
        for p in self.placements:
            if p not in distinct:
                distinct.append(p)
        check_disjoint(distinct)
        if any(self.placements[i] != distinct[i % len(distinct)] for i in range(len(stages))):
            raise GlobalTensorError(
                f"expected stage i on placement i % {len(distinct)} (stages in order, the "
                f"placements repeating), found "
                + ", ".join(f"stage {i} on {p!r}" for i, p in enumerate(self.placements)))
        schedules.check(schedule, len(stages), len(distinct), microbatches)
        self.microbatches, self.schedule = microbatches, schedule
        self._places = distinct
        self._orders = schedules.orders(schedule, len(stages), len(distinct), microbatches)
        schedules.clock(self._orders, len(stages))  # refuses a list that could wait forever
        for p in distinct:  # every rank makes every stage's groups, in one order
            create_placement_groups(p)
        self._warned_uneven = False    # uneven micro-batches: said once, on rank 0
        self._sent_meta: set = set()   # (boundary, key) whose layouts this rank has sent
        self._layouts: dict = {}       # (boundary, key) -> [(src, dst, dtype, requires_grad)]

    # ------------------------------------------------------------------------------ the API
    def table(self, forward_only: bool = False) -> str:
        """The schedule as a table: stage x time step (one tick per task)."""
        k = len(self._places)
        lists = schedules.orders(self.schedule, len(self.stages), k, self.microbatches,
                                 backward=not forward_only)
        return schedules.render(schedules.clock(lists, len(self.stages)), len(self.stages), k)

    def step(self, *inputs, target=None, loss_fn: Callable | None = None) -> float:
        """Forward and backward of every micro-batch; returns the mean of the micro-batches'
        losses (a float, on every rank) and leaves the gradients accumulated in the stages'
        parameters, reduced over each stage's data-parallel axes once."""
        if target is None or loss_fn is None:
            raise GlobalTensorError(
                "Pipeline.step needs target= and loss_fn=, e.g. pipe.step(x, target=y, "
                "loss_fn=torch.nn.functional.cross_entropy); pipe(x) runs forward only")
        run = _Run(self, inputs, target, loss_fn, backward=torch.is_grad_enabled())
        run.go(self._orders if run.backward else self._forward_orders())
        return run.loss()

    def __call__(self, *inputs):
        """Forward only (no gradients): the micro-batches' outputs joined along dim 0, a global
        tensor on the last stage's placement (on every rank)."""
        with torch.no_grad():
            run = _Run(self, inputs, None, None, backward=False)
            run.go(self._forward_orders())
            return run.joined()

    def _forward_orders(self):
        return schedules.orders(self.schedule, len(self.stages), len(self._places),
                                self.microbatches, backward=False)

    def parameters(self):
        for stage in self.stages:
            yield from stage.parameters()

    def __repr__(self):
        return (f"Pipeline({len(self.stages)} stages on {len(self._places)} placements, "
                f"{self.microbatches} micro-batches, {self.schedule!r})")


def _tag(kind: int, boundary: int, microbatch: int, stages: int) -> int:
    """Odd tags, one per message kind, boundary and micro-batch (a plan's own tags are even)."""
    return 1 + 2 * ((microbatch * stages + boundary) * 3 + kind)


class _Run:
    """One step (or one forward-only call) on this rank."""

    def __init__(self, pipe: Pipeline, inputs, target, loss_fn, backward: bool):
        self.pipe, self.loss_fn, self.backward = pipe, loss_fn, backward
        self.rank = world.get_rank()
        self.last = len(pipe.stages) - 1
        inputs = checked_inputs(inputs, target)
        rows = inputs[0].shape[0]
        if pipe.microbatches > rows:
            raise GlobalTensorError(
                f"expected at most {rows} micro-batches for a batch of {rows} rows, found "
                f"microbatches={pipe.microbatches}; use fewer micro-batches or a larger batch")
        if rows % pipe.microbatches and not pipe._warned_uneven:
            pipe._warned_uneven = True
            if world.get_rank() == 0:
                sizes = split_sizes(rows, pipe.microbatches)
                warnings.warn(
                    f"gt.nn.Pipeline: a batch of {rows} rows in {pipe.microbatches} micro-batches "
                    f"makes uneven micro-batches ({', '.join(map(str, sizes))} rows): the loss "
                    f"and gradients are the mean of the micro-batches' losses (torch "
                    f"pipelining's rule), which is not the whole batch's mean loss. Use a batch "
                    f"that microbatches divides for one process's numbers (docs/pipeline.md)",
                    stacklevel=4)
        bounds, at = [], 0
        for n in split_sizes(rows, pipe.microbatches):
            bounds.append((at, at + n))
            at += n
        # the micro-batches' shapes name a stage's output layouts (the same on every rank)
        self.keys = [tuple((hi - lo,) + tuple(x.shape[1:]) + (x.dtype,) for x in inputs)
                     for lo, hi in bounds]
        first, last = pipe.placements[0], pipe.placements[-1]
        with torch.no_grad():  # every rank moves the micro-batches to the first and last stage
            per_input = [split_batch(x, first, bounds) for x in inputs]
            self.inputs = [list(mb) for mb in zip(*per_input)]
            self.targets = split_batch(target, last, bounds) if target is not None else None
        self.saved: dict = {}       # (stage, micro-batch) -> what its backward needs
        self.outputs: dict = {}     # micro-batch -> the last stage's output (forward only)
        self.losses: dict = {}      # micro-batch -> its loss value (last stage)
        self.posted: dict = {}      # (kind, stage, micro-batch) -> Incoming list
        self.sending: list[Outgoing] = []       # sends waited for at the end
        self.grads_out: dict = {}               # stage -> [(micro-batch, Outgoing)] of gradients
        # gt.simulate plays every rank: every stage's tasks, in clock order, messages kept here
        self.sim = simulated()
        self.mailbox: dict = {}
        self.mine = [i for i, p in enumerate(pipe.placements) if self.rank in p or self.sim]

    # ------------------------------------------------------------------ running the tasks
    def go(self, orders) -> None:
        place = next((i for i, p in enumerate(self.pipe._places) if self.rank in p), None)
        tasks = orders[place] if place is not None else []
        following = {a: b for ts in orders for a, b in zip(ts, ts[1:])}
        if self.sim:
            tasks = [t for row in schedules.clock(orders, len(self.pipe.stages)) for t in row if t]
        # where each task sits in its placement's list: what a message from a stage proves
        # the sending placement has finished
        self.index = {t: i for ts in orders for i, t in enumerate(ts)}
        params = [p for s in self.mine for p in self.pipe.stages[s].parameters() if p.requires_grad]
        with no_new_groups("a pipeline stage"), deferred_reduction(params):
            for task in tasks:
                try:
                    if task in following:  # the receives of this placement's next task
                        self._prefetch(following[task])
                    if task.kind == "F":
                        self._forward(task.stage, task.microbatch)
                    else:
                        self._backward(task.stage, task.microbatch)
                except failure.LocalOpFailed:
                    raise  # published already (here or by a peer): every rank raises it
                except Exception as e:
                    # the other stages wait on receives from this one: tell them, close this
                    # rank's connections (their waits end at once), raise it here too
                    kind = "forward" if task.kind == "F" else "backward"
                    where = f"gt.nn.Pipeline: stage {task.stage}'s {kind} of micro-batch " \
                            f"{task.microbatch}"
                    seen = failure.seen()  # a peer failed first (and closed what this used)
                    if seen is not None:
                        raise failure.failed_elsewhere(seen, where) from e
                    raise failure.stage_failure(where, e) from e
            for out in self.sending + [o for outs in self.grads_out.values() for _, o in outs]:
                out.wait()
            self.sending.clear()
            self.grads_out.clear()
            if self.backward:  # the data-parallel reduction, once per step
                reduce_gradients(list(reversed(params)))

    def _forward(self, s: int, m: int) -> None:
        stage = self.pipe.stages[s]
        args = self.inputs[m] if s == 0 else self._received(_ACTIVATION, s, m)
        out = stage(*args)
        outs = tensors_of(out, s)
        if s == self.last:
            if self.loss_fn is None:
                self.outputs[m] = out
                return
            loss = self.loss_fn(out, self.targets[m])
            if not isinstance(loss, GlobalTensor) or loss.dim() != 0:
                raise GlobalTensorError(
                    f"expected loss_fn to return a global 0-dim tensor (a mean or a sum), found "
                    f"{type(loss).__name__} of shape {list(getattr(loss, 'shape', []))}")
            scaled = loss / self.pipe.microbatches  # the gradient of the micro-batches' mean
            self.losses[m] = loss.detach()
            if self.backward:
                self.saved[(s, m)] = ([scaled], None, args)
            return
        sent = [t.to_global(sbp=sent_sbp(t.sbp)) if t._layout.is_partial else t for t in outs]
        out = self._send_activations(s, m, sent)
        if self.backward:  # the sends are waited for once the next stage's gradient is back
            self.saved[(s, m)] = (sent, out, args)
        else:
            self.sending.append(out)

    def _backward(self, s: int, m: int) -> None:
        sent, out, args = self.saved.pop((s, m))
        if s == self.last:
            torch.autograd.backward(sent)
        else:
            grads = self._received(_GRADIENT, s, m)
            out.wait()  # received: the next stage ran this micro-batch's backward
            pairs = [(t, g) for t, g in zip(sent, grads) if t.requires_grad]
            if pairs:
                torch.autograd.backward([t for t, _ in pairs], [g for _, g in pairs])
        if s > 0:
            self._send_gradients(s, m, args)

    # ------------------------------------------------------------------ the messages
    def _send_activations(self, s: int, m: int, outs) -> Outgoing:
        pipe, nxt = self.pipe, self.pipe.placements[s + 1]
        key = (s, self.keys[m])
        layouts = [(t._layout, Layout(nxt, sbp_on(t.sbp, nxt), t._layout.shape), t.dtype,
                    t.requires_grad) for t in outs]
        out = Outgoing()
        what = f"pipeline: stage {s} -> {s + 1} activations (micro-batch {m})"
        moves = [(exchange(src, dst), t.element_size()) for t, (src, dst, _, _) in zip(outs, layouts)]
        first = key not in pipe._sent_meta
        if first:  # the layouts, once per input shape: the stage's first rank sends them
            pipe._sent_meta.add(key)
            pipe._layouts[key] = layouts
            why = wire.Why("metadata", f"pipeline: stage {s} -> {s + 1} layouts", "pipeline")
            wire.announce("send", why, (pipe.placements[s].flat_ranks[0],),
                          object_bytes(layouts, len(nxt.flat_ranks)))
        if self.sim:
            self.mailbox[(_ACTIVATION, s + 1, m)] = [(t, dst) for t, (_, dst, _, _) in zip(outs, layouts)]
            self._announce(what, moves, s)
            return out
        if first and self.rank == pipe.placements[s].flat_ranks[0]:
            send_object(out, layouts, nxt.flat_ranks, _tag(_META, s, m, len(pipe.stages)))
        control = out.nbytes  # the layouts: not the model's traffic (as a plan's first-use check)
        tag = _tag(_ACTIVATION, s, m, len(pipe.stages))
        for t, (ex, _) in zip(outs, moves):
            send_piece(out, ex, t._local, self.rank, tag)
        self._announce(what, moves, s, out.nbytes - control)
        return out

    def _announce(self, what: str, moves, s: int, nbytes: int = 0) -> None:
        """The wire hears of one micro-batch's sends from stage ``s`` (each of its ranks'
        bytes, from the moves; ``nbytes``: this rank's, as posted)."""
        by_rank = dict.fromkeys(self.pipe.placements[s].flat_ranks, 0)
        for ex, itemsize in moves:
            for move in ex.moves:
                others = sum(1 for d in move.dsts if d != move.src)
                by_rank[move.src] += others * itemsize * box_numel(move.region)
        wire.announce("send", wire.Why("pipeline", what, "pipeline"), tuple(by_rank),
                      max(by_rank.values(), default=0), by_rank=by_rank)

    def _send_gradients(self, s: int, m: int, args) -> None:
        layouts = self.pipe._layouts[(s - 1, self.keys[m])]
        out = Outgoing()
        tag = _tag(_GRADIENT, s - 1, m, len(self.pipe.stages))
        moves, mailed = [], []
        for a, (src, dst, dtype, requires_grad) in zip(args, layouts):
            if not requires_grad:
                mailed.append(None)
                continue
            grad = a.grad
            if grad is None:  # the stage did not use this input
                grad = GlobalTensor._make(a._local.new_zeros(dst.local_shape_of_rank(self.rank)), dst)
            else:
                grad = redistribute(grad, dst)
            moves.append((exchange(dst, src), grad.element_size()))
            if self.sim:  # held until it is known to have arrived, as a real send's buffer
                mailed.append((grad, src))
                out.buffers.append(grad)
            else:
                send_piece(out, moves[-1][0], grad._local, self.rank, tag)
        what = f"pipeline: stage {s} -> {s - 1} gradients (micro-batch {m})"
        self._announce(what, moves, s, out.nbytes)
        if self.sim:
            self.mailbox[(_GRADIENT, s - 1, m)] = mailed
        self.grads_out.setdefault(s, []).append((m, out))

    def _received_from(self, s: int, m: int) -> None:
        """The activations of micro-batch ``m`` came from stage ``s - 1``: the gradients this
        rank sent it for backwards that ran before that forward have arrived; their sends end."""
        sent_at = self.index[Task("F", s - 1, m)]
        pending = self.grads_out.get(s, [])
        for done in [(j, o) for j, o in pending if self.index[Task("B", s - 1, j)] < sent_at]:
            done[1].wait()
            pending.remove(done)

    def _layouts_for(self, boundary: int, m: int):
        key = (boundary, self.keys[m])
        layouts = self.pipe._layouts.get(key)
        if layouts is None:
            src = self.pipe.placements[boundary].flat_ranks[0]
            layouts = recv_object(src, _tag(_META, boundary, m, len(self.pipe.stages)))
            self.pipe._layouts[key] = layouts
        return layouts

    def _post(self, kind: int, s: int, m: int) -> list:
        """Post the receives of stage ``s``'s activations (kind _ACTIVATION) or of the
        gradients of its outputs (_GRADIENT) for micro-batch ``m``."""
        boundary = s - 1 if kind == _ACTIVATION else s
        layouts = self._layouts_for(boundary, m)
        tag = _tag(kind, boundary, m, len(self.pipe.stages))
        device = next(self.pipe.stages[s].parameters())._local.device
        if self.sim:  # what a real rank allocates when it posts its receives
            return [blank(dst if kind == _ACTIVATION else src, dtype)
                    if kind == _ACTIVATION or rg else None for src, dst, dtype, rg in layouts]
        if kind == _ACTIVATION:
            return [Incoming(exchange(src, dst), self.rank, dtype, device, tag)
                    for src, dst, dtype, _ in layouts]
        return [Incoming(exchange(dst, src), self.rank, dtype, device, tag) if rg else None
                for src, dst, dtype, rg in layouts]

    def _prefetch(self, task: Task) -> None:
        kind, s, m = task
        if (kind == "F" and s > 0) or (kind == "B" and s < self.last):
            which = _ACTIVATION if kind == "F" else _GRADIENT
            boundary = s - 1 if kind == "F" else s
            if (boundary, self.keys[m]) in self.pipe._layouts and (which, s, m) not in self.posted:
                self.posted[(which, s, m)] = self._post(which, s, m)

    def _received(self, kind: int, s: int, m: int) -> list:
        if self.sim:  # what arrives is counted from when the receiving rank takes it
            sent = self.mailbox.pop((kind, s, m))
            out = self.posted.pop((kind, s, m), None) or [
                None if one is None else blank(one[1], one[0].dtype) for one in sent]
            if kind == _ACTIVATION:
                self._received_from(s, m)
                layouts = self.pipe._layouts[(s - 1, self.keys[m])]
                for t, (_, _, _, requires_grad) in zip(out, layouts):
                    if requires_grad and self.backward:
                        t.requires_grad_(True)
            return out
        incoming = self.posted.pop((kind, s, m), None)
        if incoming is None:
            incoming = self._post(kind, s, m)
        boundary = s - 1 if kind == _ACTIVATION else s
        layouts = self.pipe._layouts[(boundary, self.keys[m])]
        out = []
        for inc, (src, dst, _, requires_grad) in zip(incoming, layouts):
            if kind == _ACTIVATION:
                t = GlobalTensor._make(inc.wait(), dst)
                self._received_from(s, m)
                if requires_grad and self.backward:
                    t.requires_grad_(True)  # its .grad comes back in dst's layout
                out.append(t)
            else:
                out.append(GlobalTensor._make(inc.wait(), src) if inc is not None else None)
        return out

    # ------------------------------------------------------------------ results
    def loss(self) -> float:
        last = self.pipe.placements[-1]
        value = None
        if self.rank in last or self.sim:
            losses = list(self.losses.values())
            total = losses[0]
            for loss in losses[1:]:  # partial sums add locally: one reduction, at the end
                total = total + loss
            total = redistribute(total, Layout(last, replicated(last.ndim), ()))
            if self.sim:  # a simulated step has no values
                return float("nan")
            value = float(total._local) / self.pipe.microbatches
        return float(object_from(last.flat_ranks[0], value))

    def joined(self):
        last = self.pipe.placements[-1]
        out, layout = None, None
        if self.rank in last or self.sim:
            outs = [self.outputs[m] for m in range(self.pipe.microbatches)]
            if isinstance(outs[0], (tuple, list)):
                out = type(outs[0])(torch.cat(parts) for parts in zip(*outs))
                layout = [t._layout for t in out]
            else:
                out = torch.cat(outs)
                layout = out._layout
        if self.sim:
            return out
        layout = object_from(last.flat_ranks[0], layout)
        if out is not None:
            return out
        if isinstance(layout, list):
            return tuple(empty_piece(lay, self.pipe) for lay in layout)
        return empty_piece(layout, self.pipe)


