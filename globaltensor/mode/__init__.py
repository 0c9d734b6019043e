"""Global mode: single-device model code runs unchanged on global tensors (OneFlow's
``utils/global_view/``), and what serves it alone.

    global_mode.py  gt.global_mode(placement, sbp): torch's factories give global tensors, a
                    local tensor meeting a global one is taken as a broadcast value
    pydata.py       Python values read from global tensors (``int(x)``, ``bool(x)``, ``len``)
    packed.py       PackedSequence on global tensors (the packing gathers a split batch)
    rnn.py          GRU / RNN / LSTM layers on each rank's own sequences when the batch is split

Imported by ``globaltensor``'s ``__init__`` and by ``nn/`` (a converted module's entry points
run in global mode), nothing else.
"""
