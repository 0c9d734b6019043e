"""``gt.simulate``: a job's memory and communication, per rank, in one process, before launch.

    simulate.py   gt.simulate(world_size, rank=0): the block, its report and figures per rank
                  (StepTime: step_time's estimate and its parts)
    factories.py  inside the block torch's factories make meta tensors (no data); scalars stay;
                  they tell no_data.py which ones the user made on meta
    ranks.py      per-rank accounting: bytes of a layout's pieces on every rank, rank classes
    memory.py     gt.memory(): live tensor bytes by kind (this rank's in a real run, every
                  rank's in a simulation)
    reach.py      what a gt.memory() block finds alive when it begins (frames, what it runs)
    no_data.py    what costs nothing: a real run's meta tensors; a simulation's user-made meta
                  tensors (a model built on meta) and what operators make from them alone
    knowable.py   values known without data (small integer aranges: positions) keep them;
                  where they meet meta tensors they become meta too

The world is torch's fake process group (world/simulated.py), the executor's simulated emitter
returns meta pieces of the right shapes (runtime/emit.py), and the figures come from the same
places a real run's do: ``gt.comm_trace``'s records (tools/trace.py) and ``gt.memory``'s
accounting (tools/memory.py), each spread over the ranks by the layouts.
"""
from .simulate import Simulation, StepTime, simulate

__all__ = ["simulate", "Simulation", "StepTime"]
