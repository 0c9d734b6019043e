"""Tools for the user who wants to see and check what the job does (DTensor's ``debug/``).

    explain.py        gt.explain(x, placement, sbp): the plan of a redistribution, with bytes
    trace.py          gt.comm_trace(): every redistribution of a block, counted and tabled
    policy.py         gt.communication("implicit" | "warn" | "explicit"): moves an op may make
    verify.py         gt.verify(): every op also computed on the full tensors, and compared
    verify_values.py  the comparison: tolerances per dtype, the rounding floor
    visualize.py      gt.visualize(x): which ranks hold which block
    balance.py        gt.attention_balance(q): the attention work each rank's queries cost

A leaf: the core never imports it. The core announces what it does through ``observe.py``
(observers held in one ContextVar); the tools register as observers. Only ``globaltensor``'s
``__init__`` imports this package.
"""
