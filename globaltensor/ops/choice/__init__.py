"""The choice of a signature for a call: the only part of ``ops/`` that imports ``plan``.

    choose.py      branch and bound over the candidates of the grid: move + backward cost
    candidates.py  the candidate table: the product of the rule's rows over the axes
    backward.py    the layouts of the gradients a candidate implies, and their cost
    balanced.py    order-free rows also over head-tail splits
"""
