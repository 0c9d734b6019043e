"""What the tensor layer needs from torch.distributed (never the user's ``gt.comm``).

    execute.py    run(plan, piece, rank): a ``match`` over plan steps
    groups.py     process groups per (placement, axis), created together, cached per world
    meta.py       one shape/dtype exchange (to_global's check_meta, gt.comm's value all_gather)
    guard.py      timeouts that explain: ``guard``, ``step_guard``, ``@guarded``
    agreement.py  GT_DEBUG: every rank agrees on each global operation (``check``)
    wire.py       the one wire: every torch.distributed data call of the tensor side, each
                  with a Why, announcing one event (kind, ranks, bytes from plan/cost.py)
    emit.py       the executor's emitters, eager, traced (functional collectives under
                  torch.compile) and simulated, over the wire: every eager/traced difference
    exchange.py   an Exchange step, eager (isend/irecv, broadcasts) and traced (one all_to_all)
    pairwise.py   gathers and reductions as batches of isend/irecv (the CPU path)
    buckets.py    gradient buckets: pieces all-reduced as one flat buffer, asynchronously
    unshard.py    a fully_shard unit's flat all-gather and reduce-scatter, and its storage
    stage_p2p.py  a pipeline stage's activations and gradients: isend/irecv without waiting
    failure.py    a failure on some ranks becomes the same error on every rank, at once
    layoutcheck.py  ranks that disagree on a redistributed tensor: one record on a plan's first use
    costs.py      the planner's cost figures: measured at the world's start, given, or cached
"""
