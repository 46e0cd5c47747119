"""Schedules as data: build, verify, simulate and draw pipeline schedules.

A :class:`Schedule` is made by :func:`build` (a registered schedule), :func:`load_csv` (a file), or by
hand with :meth:`Schedule.from_programs`. Pure Python: importing this package never imports torch.

From a builder to the program a rank runs, in the order the code does it:

1. **Build** (``registry.build`` -> ``builtin/<name>.py``): a builder writes, per rank, the
   ordered compute actions ``F`` / ``B`` / ``I`` / ``W`` of its stages
   (:class:`~conveyor.schedule.ir.Action`: kind, stage, microbatch; ``"2F0"`` in print) and a
   :class:`Placement` (which rank runs each stage).
2. **Schedule** (``ir.py``): the placement plus one program per rank, frozen. A program of
   well-formed actions is held as a :class:`~conveyor.schedule.ir.PackedProgram` (one integer
   per action, read as Actions); anything else stays as given, for the verifier to name.
3. **Verify** (``verify.py``): one pass of the engine's stepping loop (``engine.runs_clean``, on
   the programs' own integer codes, lowered or not) says whether every rank runs to its end with every action once; only
   a schedule that fails is walked through the checks one by one for a message naming the
   first violation (a missing action, a duplicate, a deadlock with its step x rank grid).
4. **Lower** (``passes.py``: :func:`executable` -> ``lower.py``): the pass chain turns the
   compute actions into what a rank executes: ``SEND_F`` / ``RECV_F`` / ``SEND_B`` / ``RECV_B``
   inserted where a neighbour stage sits on another rank, an ``I`` directly followed by its own
   ``W`` merged into one ``B``, and the forward-only programs of evaluation. A schedule may name
   pairs of a forward and a backward of other microbatches that a rank runs overlapped
   (``Schedule.overlapped``, :func:`pair_forward_backward`: an MoE layer's all-to-alls of one hide
   behind the other's compute); lowering puts both receives before a pair and both sends after it.
   Last, ``posts.py`` (:func:`~conveyor.schedule.posts.rank_channels`, then
   :func:`~conveyor.schedule.posts.place_posts`) writes where each rank posts its sends and
   receives, and which go together, for the transport's discipline: look-ahead (matched by
   address) or in order (matched by order, as NCCL: DualPipe's queue-then-commit), and which
   channels arrive in their sender's order; the chain keeps them per rank beside its programs
   (``train_posts(rank, discipline)``, ``in_order_channels(rank)``).
   :func:`~conveyor.schedule.posts.check_posts` proves those posts free of deadlock in the engine.
5. **Simulate** (``simulate.py``): the same engine times each action on a
   :class:`CostModel` into a :class:`Timeline` (makespan, bubble, peak activations), which
   ``render.py`` draws and ``conveyor simulate`` prints. It times the very programs of step 4.
6. **Run** (``conveyor.runtime``, not this package): each rank's executor walks
   ``executable(schedule).train_program(rank)`` action by action, one handler per kind; before
   each action it posts the batches of sends and receives that step 4's posts name there
   (``train_posts(rank, discipline)``, the discipline its transport declares), over whichever
   transport (one contract for all of them), and a RECV waits on its handle; a new schedule
   needs no runtime change.

Example (the six steps on two ranks):
    >>> import conveyor.schedule as cs
    >>> sched = cs.build("1f1b", ranks=2, microbatches=2)           # 1-3: built, a Schedule, verified
    >>> [str(a) for a in sched.programs[1]]
    ['1F0', '1B0', '1F1', '1B1']
    >>> runs = cs.executable(sched)                                # 4: the pass chain
    >>> [str(a) for a in runs.train_program(1)]                    # 6: what rank 1 executes
    ['1RECV_F0', '1F0', '1B0', '1SEND_B0', '1RECV_F1', '1F1', '1B1', '1SEND_B1']
    >>> cs.simulate(runs.train).makespan                           # 5: F=I=W=1, so B=2
    9.0
    >>> sched = cs.build("1f1b", ranks=4, microbatches=8)
    >>> sched.stages_of(2)
    [2]
    >>> round(cs.simulate(sched).bubble_ratio, 3)
    0.273
"""

from conveyor.schedule.cost import CostModel, StageCosts
from conveyor.schedule.csv_io import (
    dumps_csv,
    infer_placement,
    load_csv,
    loads_csv,
    parse_schedule,
    save_csv,
)
from conveyor.schedule.grid import render_grid
from conveyor.schedule.ir import Action, ActionKind, Placement, Schedule
from conveyor.schedule.lower import lower
from conveyor.schedule.overlap import PairTiming, overlap_pair, pair_forward_backward, pair_timing, pairs_of
from conveyor.schedule.passes import Executable, executable
from conveyor.schedule.registry import available, build, register, unregister
from conveyor.schedule.simulate import simulate
from conveyor.schedule.timeline import CommSpan, Span, Timeline
from conveyor.schedule.verify import verify

__all__ = [
    "Action",
    "ActionKind",
    "CommSpan",
    "CostModel",
    "Executable",
    "PairTiming",
    "Placement",
    "Schedule",
    "Span",
    "StageCosts",
    "Timeline",
    "available",
    "build",
    "dumps_csv",
    "executable",
    "infer_placement",
    "load_csv",
    "loads_csv",
    "lower",
    "overlap_pair",
    "pair_forward_backward",
    "pair_timing",
    "pairs_of",
    "parse_schedule",
    "register",
    "render_grid",
    "save_csv",
    "simulate",
    "unregister",
    "verify",
]
