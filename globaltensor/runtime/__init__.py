"""What the tensor layer needs from torch.distributed (never the user's ``gt.comm``).

    execute.py    run(plan, piece, rank): a ``match`` over plan steps
    groups.py     process groups per (placement, axis), created together, cached per world
    meta.py       one shape/dtype exchange (to_global's check_meta, gt.comm's value all_gather)
    guard.py      timeouts that explain: ``guard``, ``step_guard``, ``@guarded``
    agreement.py  GT_DEBUG: every rank agrees on each global operation (``check``)
"""
