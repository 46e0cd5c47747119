"""Point-to-point posts that match by order, as NCCL matches them: what each rank posts, and when.

NCCL ignores tags: the n-th send from rank a to rank b meets the n-th receive that b posts
from a. A lowered program does not always receive in the order its peer sends (an
interleaved or zero-bubble schedule may consume a backward gradient before a forward the
peer sent first), so an order-matching transport posts the receives of each pair in the
*sender's* order: reaching a receive, a rank first posts every earlier message of that
pair still unposted (their buffers wait until their own receive action comes).

Each channel (src, dst) gets a communicator of its own (a process group of the two ranks),
so that its operations complete in their own order: under NCCL, the operations of one
communicator run one after the other on one stream, and a send from a to b queued behind a
receive from b could wait for a transfer that b sends only after the send arrives. With one
communicator per direction, a send waits only for its receiver to post, as with tags.
What a rank posts over one channel at one point goes as one batch
(``torch.distributed.batch_isend_irecv``). :func:`check_posts` simulates every rank's posts
and waits under that model and names the ranks that would wait forever; :func:`check_first_step`
replays what blocks the *host* in a first step under NCCL (a structure not yet published, a
communicator made at its first use), which is why the runtime makes every channel's
communicator when the pipeline is built.

Pure Python over :mod:`conveyor.schedule.ir`: the schedule layer's programs are its input.
:func:`check_posts` and :func:`check_first_step` step the ranks with a loop of their own, not
the schedule engine's (:mod:`conveyor.schedule.engine`): there each action waits for one
thing, the action that produced its (kind, stage, microbatch). Here what is stepped is the
posts, and a wait ends when every operation of a batch has met the operation at the same
position of its channel's queue on the peer: several needs per wait, matched by position in a
channel rather than by name, and the posting order itself is what may deadlock.

Example:
    >>> import conveyor.schedule as cs
    >>> sched = cs.build("1f1b", ranks=2, microbatches=2)
    >>> orders = sender_orders(sched, training=True)
    >>> orders[(0, 1)]
    [(0, 0, 0), (0, 0, 1)]
    >>> lowered = cs.executable(sched).train
    >>> posts = [posting_of(p, r, sched.placement, orders, True) for r, p in enumerate(lowered.programs)]
    >>> [[[str(a) for a in batch] for batch in batches] for batches in posts[1].values()]
    [[['1RECV_F0']], [['1SEND_B0'], ['1RECV_F1']], [['1SEND_B1']]]
    >>> check_posts(lowered.programs, posts, sched.placement) is None
    True
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from conveyor.schedule.ir import Action, ActionKind, Placement, Schedule

K = ActionKind
# The wire's directions (conveyor.runtime.wire), repeated here to keep this module torch-free.
FORWARD, BACKWARD, EVAL_FORWARD = 0, 1, 2
Key = tuple[int, int, int]  # (direction, sending stage, microbatch)
Orders = Mapping[tuple[int, int], Sequence[Key]]  # (src, dst) -> what src sends dst, in order
# First comm action of a run -> what is posted there: one batch of actions per channel.
Posting = dict[Action, tuple[tuple[Action, ...], ...]]


def sender_orders(schedule: Schedule, training: bool) -> dict[tuple[int, int], list[Key]]:
    """{(src, dst): the transfers src sends dst in one step, in order}, from the source schedule.

    Lowering puts each send right after the action that produces it and keeps sends placed
    by hand where they are (:mod:`conveyor.schedule.lower`), so the order follows from the
    compute programs. ``training=False``: the forward-only programs of an evaluation.
    """
    place = schedule.placement
    last = place.num_stages - 1
    orders: dict[tuple[int, int], list[Key]] = {}
    for rank, program in enumerate(schedule.programs):
        placed = {(a.kind, a.stage, a.microbatch) for a in program if a.kind in (K.SEND_F, K.SEND_B)} if training else set()
        for a in program:
            s, m = a.stage, a.microbatch
            key = peer = None
            sends_f = a.kind is K.SEND_F or (a.kind is K.F and s < last and (K.SEND_F, s, m) not in placed)
            sends_b = a.kind is K.SEND_B or (a.kind in (K.B, K.I) and s > 0 and (K.SEND_B, s, m) not in placed)
            if sends_f and (training or a.kind is K.F):
                key, peer = (FORWARD if training else EVAL_FORWARD, s, m), place.rank_of(s + 1)
            elif sends_b and training:
                key, peer = (BACKWARD, s, m), place.rank_of(s - 1)
            if key is not None and peer != rank:
                orders.setdefault((rank, peer), []).append(key)
    return orders


def transfer_of(action: Action, placement: Placement, training: bool) -> tuple[int, Key]:
    """(peer, transfer key) of a SEND_* or RECV_* action of a lowered program."""
    s, m = action.stage, action.microbatch
    forward = FORWARD if training else EVAL_FORWARD
    if action.kind is K.SEND_F:
        return placement.rank_of(s + 1), (forward, s, m)
    if action.kind is K.SEND_B:
        return placement.rank_of(s - 1), (BACKWARD, s, m)
    if action.kind is K.RECV_F:
        return placement.rank_of(s - 1), (forward, s - 1, m)
    return placement.rank_of(s + 1), (BACKWARD, s + 1, m)


def _receive_of(key: Key) -> Action:
    direction, stage, m = key
    return Action(K.RECV_B, stage - 1, m) if direction == BACKWARD else Action(K.RECV_F, stage + 1, m)


def posting_of(program: Sequence[Action], rank: int, placement: Placement, orders: Orders, training: bool) -> Posting:
    """Where ``rank`` posts its sends and receives: {first action of a run of comm actions: batches}.

    A batch is what goes over one channel (src, dst) at that point, in order: the sends of the
    run to one peer, or the receives from one peer, each receive bringing the earlier
    transfers of its channel (sender's order) not yet posted. Raises ValueError if the
    program sends in another order than ``orders`` says, or waits for what no peer sends.
    """
    position = {pair[0]: {key: i for i, key in enumerate(keys)} for pair, keys in orders.items() if pair[1] == rank}
    posted = dict.fromkeys(position, 0)
    sent: dict[int, list[Key]] = {}
    posting: Posting = {}
    index = 0
    while index < len(program):
        if program[index].kind.is_compute:
            index += 1
            continue
        first, batches = program[index], {}
        while index < len(program) and program[index].kind.is_comm:
            action = program[index]
            peer, key = transfer_of(action, placement, training)
            if action.kind in (K.SEND_F, K.SEND_B):
                sent.setdefault(peer, []).append(key)
                batches.setdefault((rank, peer), []).append(action)
            else:
                at = position.get(peer, {}).get(key)
                if at is None:
                    raise ValueError(f"rank {rank}'s {action} waits for {key} from rank {peer}, which never sends it")
                while posted[peer] <= at:
                    batches.setdefault((peer, rank), []).append(_receive_of(orders[(peer, rank)][posted[peer]]))
                    posted[peer] += 1
            index += 1
        if batches:
            posting[first] = tuple(tuple(batch) for batch in batches.values())
    for peer, keys in sent.items():
        if list(orders.get((rank, peer), ())) != keys:
            raise ValueError(f"rank {rank} sends rank {peer} {keys}, not in the order {list(orders.get((rank, peer), ()))}")
    return posting


Op = tuple[int, int, str, int]  # (src, dst, "send" or "recv", n-th on that channel and side)


def check_posts(programs: Sequence[Sequence[Action]], postings: Sequence[Posting], placement: Placement,
                training: bool = True) -> str | None:
    """None if every rank's posts complete when matched by order; else what goes wrong.

    The model is NCCL's: each channel (src, dst) is a communicator of its own whose
    operations complete in the order posted, the n-th send meeting the n-th receive (they
    must name the same transfer); a batch completes when all its operations have; a rank
    posts in program order and, at each receive action, waits for the batch holding that
    receive before anything after it runs or is posted (a send may wait for its receiver,
    never the sender's program).
    """
    posts = _posts(programs, postings, placement, training)
    if isinstance(posts, str):
        return posts
    return _simulate(posts.events, posts.fifo, posts.batch_ops)


class _Posts:
    """Every rank's posts and waits in program order, and what each batch carries."""

    def __init__(self) -> None:
        self.events: list[list[tuple[str, Any]]] = []
        self.fifo: dict[tuple[int, int, str], list[tuple[Key, int]]] = {}  # channel side -> (key, batch id)
        self.batch_ops: list[int] = []  # per batch id: operations not yet complete
        self.batches: list[tuple[tuple[int, int], bool, list[Key]]] = []  # per batch id: channel, sends?, keys


def _posts(programs: Sequence[Sequence[Action]], postings: Sequence[Posting], placement: Placement,
           training: bool) -> _Posts | str:
    """The posts and waits of every rank, or what makes them unusable (a wait never posted, mismatched orders)."""
    out = _Posts()
    where: dict[tuple[int, Action], int] = {}  # (rank, receive action) -> its batch id
    for rank, (program, posting) in enumerate(zip(programs, postings)):
        mine: list[tuple[str, Any]] = []
        for action in program:
            for batch in posting.get(action, ()):
                batch_id = len(out.batch_ops)
                out.batch_ops.append(len(batch))
                keys = []
                for op in batch:
                    peer, key = transfer_of(op, placement, training)
                    sending = op.kind in (K.SEND_F, K.SEND_B)
                    side = (rank, peer, "send") if sending else (peer, rank, "recv")
                    out.fifo.setdefault(side, []).append((key, batch_id))
                    keys.append(key)
                    if not sending:
                        where[(rank, op)] = batch_id
                out.batches.append((side[:2], sending, keys))
                mine.append(("post", batch_id))
            if action.kind in (K.RECV_F, K.RECV_B):
                if (rank, action) not in where:
                    return f"rank {rank} waits at {action} for a receive it never posted"
                mine.append(("wait", where[(rank, action)]))
        out.events.append(mine)
    for (src, dst, side), ops in out.fifo.items():
        other = out.fifo.get((src, dst, "recv" if side == "send" else "send"), [])
        if [key for key, _ in ops] != [key for key, _ in other]:
            return (f"rank {src} sends rank {dst} {[key for key, _ in out.fifo.get((src, dst, 'send'), [])]}, "
                    f"but rank {dst} receives {[key for key, _ in out.fifo.get((src, dst, 'recv'), [])]}")
    return out


def check_first_step(programs: Sequence[Sequence[Action]], postings: Sequence[Posting], placement: Placement,
                     training: bool = True, *, lazy_communicators: bool, structures_known: bool = False) -> str | None:
    """None if no rank's host blocks forever in a first step under NCCL; else who waits for what.

    The data's completion is :func:`check_posts`'s: here only what blocks the *host* counts, as
    NCCL does it (a wait on a NCCL work orders the stream and returns; posting returns at once):

    - **structure**: posting a receive whose structure is not known yet (the first time that
      transfer happens, not given in ``TransferOptions(shapes=...)``) waits until the sender reached
      the post that sends it (it publishes the structure there, before posting);
    - **communicator** (``lazy_communicators``): a channel's communicator is created at the
      first operation on it, and creating it (``ncclCommInitRank``) blocks until both its ranks
      reached their first post on that channel (after the structure waits of that post).

    ``structures_known``: every structure was given (or a step already ran). A rank that
    blocks on neither runs its program to the end, so the host cannot deadlock.

    Example:
        >>> import conveyor.schedule as cs
        >>> sched = cs.build("zb-h1", ranks=3, microbatches=4, virtual=2)
        >>> orders = sender_orders(sched, training=True)
        >>> programs = cs.executable(sched).train.programs
        >>> postings = [posting_of(p, r, sched.placement, orders, True) for r, p in enumerate(programs)]
        >>> check_first_step(programs, postings, sched.placement, lazy_communicators=True) is None
        False
        >>> check_first_step(programs, postings, sched.placement, lazy_communicators=False) is None
        True
    """
    posts = _posts(programs, postings, placement, training)
    if isinstance(posts, str):
        return posts
    published: set[Key] = set()
    created: set[tuple[int, int]] = set() if lazy_communicators else {channel for channel, _, _ in posts.batches}
    arrived: dict[tuple[int, int], set[int]] = {}
    at = [0] * len(posts.events)
    blocked: dict[int, str] = {}
    moved = True
    while moved:
        moved = False
        for rank, mine in enumerate(posts.events):
            while at[rank] < len(mine):
                what, batch_id = mine[at[rank]]
                if what == "post":
                    channel, sending, keys = posts.batches[batch_id]
                    missing = [] if sending or structures_known else [k for k in keys if k not in published]
                    if missing:
                        blocked[rank] = f"the structure of {missing[0]} from rank {channel[0]}"
                        break
                    if sending:
                        published.update(keys)
                    if channel not in created:
                        arrived.setdefault(channel, set()).add(rank)
                        if len(arrived[channel]) < 2:
                            blocked[rank] = f"rank {channel[1 - channel.index(rank)]} to create channel {channel}"
                            break
                        created.add(channel)
                blocked.pop(rank, None)
                at[rank] += 1
                moved = True
    if all(at[rank] == len(mine) for rank, mine in enumerate(posts.events)):
        return None
    return "; ".join(f"rank {rank} blocks in its host event #{at[rank]}, waiting for {blocked[rank]}"
                     for rank in sorted(blocked))


def _simulate(events: list[list[tuple[str, Any]]], fifo: dict[tuple[int, int, str], list[tuple[Key, int]]],
              batch_ops: list[int]) -> str | None:
    """Run every rank's posts and waits (see :func:`check_posts`) until all are done or none moves."""
    at = [0] * len(events)
    posted: set[int] = set()
    head = dict.fromkeys(fifo, 0)
    while True:
        progress = False
        for rank, mine in enumerate(events):
            while at[rank] < len(mine):
                what, batch_id = mine[at[rank]]
                if what == "post":
                    posted.add(batch_id)
                elif batch_ops[batch_id]:
                    break
                at[rank] += 1
                progress = True
        for (src, dst, side), ops in fifo.items():
            if side != "send":
                continue
            receives = fifo[(src, dst, "recv")]
            while (head[(src, dst, "send")] < len(ops) and ops[head[(src, dst, "send")]][1] in posted
                   and receives[head[(src, dst, "recv")]][1] in posted):
                batch_ops[ops[head[(src, dst, "send")]][1]] -= 1
                batch_ops[receives[head[(src, dst, "recv")]][1]] -= 1
                head[(src, dst, "send")] += 1
                head[(src, dst, "recv")] += 1
                progress = True
        if all(at[rank] == len(mine) for rank, mine in enumerate(events)):
            unsent = [side for side, ops in fifo.items() if head[side] < len(ops)]
            return None if not unsent else f"posted but never matched: {unsent}"
        if not progress:
            return "; ".join(f"rank {rank} waits at its event #{at[rank]} ({mine[at[rank]][0]} of batch "
                             f"{mine[at[rank]][1]})" for rank, mine in enumerate(events) if at[rank] < len(mine))
