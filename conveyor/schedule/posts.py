"""Where each rank posts its sends and receives: the last step of lowering, as data.

A lowered program says *which* transfers a rank makes and where it waits for one (its
SEND_* and RECV_* actions). How a transport matches transfers decides *when* a rank must
post them, and which go together:

- :data:`LOOKAHEAD` (matched by address: gloo's process group, shared memory, one
  process): each send is posted where its SEND action stands, each receive
  :data:`RECEIVES_AHEAD` receives before its RECV, early enough that the data finds its
  buffer waiting, late enough not to hold every activation at once.
- :data:`IN_ORDER` (matched by order, as NCCL does: the n-th send from rank a to rank b
  meets the n-th receive b posts from a): at the first action of each run of SEND/RECV
  actions the run's sends to one peer go as one batch, and the run's receives bring every
  earlier transfer of their channel, in the *sender's* order, as one batch (DualPipe's
  queue-then-commit). A program that consumes out of its sender's order (an interleaved
  or zero-bubble schedule may) thereby still posts in that order.

:func:`rank_channels` reads, once per rank and program, what the rank's channels carry: the
order each peer sends to it (which the in-order discipline posts in), and which channels
their receiver consumes in their sender's order (a transport may post those ahead, sized
like the last transfer). :func:`place_posts` writes the posts from them: for each action of a
rank's program, the batches posted right before it runs; the executor posts exactly these,
whatever the transport. Both read only the rank's program and its peers'
(:class:`~conveyor.schedule.passes.Executable` keeps them with the programs, per rank).
:func:`check_posts` proves the posts complete and free of deadlock by stepping it in the
schedule engine (:func:`posted_programs` writes the posts and waits as actions it knows).

Every transfer has one address from the action to the wire, :func:`transfer_of`'s
``(direction, sending stage, microbatch)``: ``FORWARD`` carries a stage's output to the
next stage, ``BACKWARD`` an input gradient to the previous one, ``EVAL_FORWARD`` the
outputs of an evaluation (they carry no gradient, so their structure differs).

Example:
    >>> import conveyor.schedule as cs
    >>> lowered = cs.lower(cs.build("1f1b", ranks=2, microbatches=2))
    >>> posts = place_posts(lowered, 1, IN_ORDER)
    >>> [(str(lowered.programs[1][i]), [[str(a) for a in b.actions] for b in batches])
    ...  for i, batches in enumerate(posts) if batches]
    [('1RECV_F0', [['1RECV_F0']]), ('1SEND_B0', [['1SEND_B0'], ['1RECV_F1']]), ('1SEND_B1', [['1SEND_B1']])]
    >>> check_posts(lowered, IN_ORDER) is None
    True
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from conveyor.errors import ScheduleError
from conveyor.schedule.engine import stuck_ranks
from conveyor.schedule.ir import Action, ActionKind, Placement, Schedule

K = ActionKind
# The directions of the wire (what a transfer carries); the runtime's wire uses these.
FORWARD, BACKWARD, EVAL_FORWARD = 0, 1, 2
TransferKey = tuple[int, int, int]  # (direction, sending stage, microbatch)
Channel = tuple[int, int]  # (direction, sending stage): the transfers of one stream

LOOKAHEAD = "lookahead"
IN_ORDER = "in_order"
DISCIPLINES = (LOOKAHEAD, IN_ORDER)
RECEIVES_AHEAD = 4  # how many receives the look-ahead discipline keeps posted


@dataclass(frozen=True, slots=True)
class Batch:
    """Transfers posted together over one channel: sends to ``peer``, or receives from it.

    ``actions`` are the SEND_* (or RECV_*) actions of this rank's program that they serve,
    ``keys`` their addresses (:func:`transfer_of`), in the order they are posted.
    """

    peer: int
    sends: bool
    actions: tuple[Action, ...]
    keys: tuple[TransferKey, ...]


RankPosts = tuple[tuple[Batch, ...], ...]
"""Per action of a rank's program (same index): the batches posted right before it runs."""


def transfer_of(action: Action, placement: Placement, forward: int = FORWARD) -> tuple[int, TransferKey]:
    """(peer rank, address) of a SEND_* or RECV_* action; ``forward``: the direction forward transfers take.

    A receive names the receiving stage (``2RECV_F0`` gets what ``1SEND_F0`` sends); its address is
    the sender's.

    Example:
        >>> from conveyor.schedule.ir import Placement
        >>> transfer_of(Action.parse("1RECV_F3"), Placement.looped(2, 1))
        (0, (0, 0, 3))
    """
    s, m, kind = action.stage, action.microbatch, action.kind
    if kind is K.SEND_F:
        return placement.rank_of(s + 1), (forward, s, m)
    if kind is K.SEND_B:
        return placement.rank_of(s - 1), (BACKWARD, s, m)
    if kind is K.RECV_F:
        return placement.rank_of(s - 1), (forward, s - 1, m)
    if kind is K.RECV_B:
        return placement.rank_of(s + 1), (BACKWARD, s + 1, m)
    raise ValueError(f"{action} moves nothing between ranks: only SEND_* and RECV_* actions have an address")


def _receive_of(key: TransferKey) -> Action:
    direction, stage, m = key
    return Action(K.RECV_B, stage - 1, m) if direction == BACKWARD else Action(K.RECV_F, stage + 1, m)


@dataclass(frozen=True, slots=True)
class RankChannels:
    """The channels one rank sends and receives on in a lowered program: the first half of the pass.

    ``orders``: {peer: the addresses the peer sends this rank, in the order it sends them} (the
    in-order discipline posts a channel's receives in that order); ``in_order``: the channels
    (direction, sending stage) this rank sends or receives on whose receiver consumes them in
    the order the sender sends (a transport may post their receives ahead, sized like the
    channel's last transfer; elsewhere it matches transfers by microbatch).
    """

    orders: Mapping[int, tuple[TransferKey, ...]]
    in_order: frozenset[Channel]


def rank_channels(lowered: Schedule, rank: int, forward: int = FORWARD) -> RankChannels:
    """:class:`RankChannels` of ``rank`` in ``lowered``, read off its program and its peers' (no other rank's).

    Example:
        >>> import conveyor.schedule as cs
        >>> found = rank_channels(cs.lower(cs.build("1f1b", ranks=2, microbatches=2)), 1)
        >>> found.orders, sorted(found.in_order)
        ({0: ((0, 0, 0), (0, 0, 1))}, [(0, 0), (1, 1)])
    """
    placement = lowered.placement
    sends, receives = _transfers(lowered.programs[rank], placement, forward)
    orders: dict[int, tuple[TransferKey, ...]] = {}
    in_order: set[Channel] = set()
    for peer in sorted(sends.keys() | receives.keys()):
        their_sends, their_receives = _transfers(lowered.programs[peer], placement, forward)
        orders[peer] = tuple(their_sends.get(rank, ()))
        in_order |= _same_order(sends.get(peer, ()), their_receives.get(rank, ()))
        in_order |= _same_order(orders[peer], receives.get(peer, ()))
    return RankChannels(orders, frozenset(in_order))


def _transfers(program: Sequence[Action], placement: Placement,
               forward: int) -> tuple[dict[int, list[TransferKey]], dict[int, list[TransferKey]]]:
    """(sends, receives) of ``program``: {peer: addresses, in program order}."""
    sends: dict[int, list[TransferKey]] = {}
    receives: dict[int, list[TransferKey]] = {}
    for action in program:
        if action.kind.is_comm:
            peer, key = transfer_of(action, placement, forward)
            is_send = action.kind is K.SEND_F or action.kind is K.SEND_B
            (sends if is_send else receives).setdefault(peer, []).append(key)
    return sends, receives


def _same_order(sent: Sequence[TransferKey], received: Sequence[TransferKey]) -> set[Channel]:
    """The channels among ``sent`` whose microbatches ``received`` lists in the same order."""
    def streams(keys: Sequence[TransferKey]) -> dict[Channel, list[int]]:
        by_channel: dict[Channel, list[int]] = {}
        for direction, stage, m in keys:
            by_channel.setdefault((direction, stage), []).append(m)
        return by_channel

    arriving = streams(received)
    return {channel for channel, order in streams(sent).items() if arriving.get(channel) == order}


def place_posts(lowered: Schedule, rank: int, discipline: str, *, forward: int = FORWARD,
               receives_ahead: int = RECEIVES_AHEAD, channels: RankChannels | None = None) -> RankPosts:
    """Where ``rank`` posts its transfers in ``lowered`` under ``discipline`` (see the module docstring).

    ``forward``: the direction of forward transfers (``EVAL_FORWARD`` for an evaluation);
    ``channels``: :func:`rank_channels` of ``rank``, when the caller has them. Raises
    ScheduleError if the program waits for what no peer sends it.
    """
    if discipline not in DISCIPLINES:
        raise ValueError(f"discipline must be one of {DISCIPLINES}; got {discipline!r}")
    program = lowered.programs[rank]
    if discipline == LOOKAHEAD:
        return _lookahead(program, lowered.placement, forward, receives_ahead)
    if channels is None:
        channels = rank_channels(lowered, rank, forward)
    return _in_order(program, rank, lowered.placement, forward, channels.orders)


def _lookahead(program: Sequence[Action], placement: Placement, forward: int, ahead: int) -> RankPosts:
    posts: list[tuple[Batch, ...]] = [()] * len(program)
    receives = [i for i, a in enumerate(program) if a.kind is K.RECV_F or a.kind is K.RECV_B]

    def single(index: int, sends: bool) -> Batch:
        peer, key = transfer_of(program[index], placement, forward)
        return Batch(peer, sends, (program[index],), (key,))

    if receives:
        # Before the first action: the first ``ahead``; at the n-th receive, the (n + ahead)-th.
        posts[0] = tuple(single(i, False) for i in receives[:ahead])
        for n, index in enumerate(receives):
            if n + ahead < len(receives):
                posts[index] += (single(receives[n + ahead], False),)
    for index, action in enumerate(program):
        if action.kind is K.SEND_F or action.kind is K.SEND_B:
            posts[index] += (single(index, True),)
    return tuple(posts)


def _in_order(program: Sequence[Action], rank: int, placement: Placement, forward: int,
              orders: Mapping[int, Sequence[TransferKey]]) -> RankPosts:
    position = {peer: {key: i for i, key in enumerate(keys)} for peer, keys in orders.items()}
    posted = dict.fromkeys(position, 0)
    posts: list[tuple[Batch, ...]] = [()] * len(program)
    index = 0
    while index < len(program):
        if program[index].kind.is_compute:
            index += 1
            continue
        first, batches = index, {}
        while index < len(program) and program[index].kind.is_comm:
            action = program[index]
            peer, key = transfer_of(action, placement, forward)
            if action.kind is K.SEND_F or action.kind is K.SEND_B:
                batches.setdefault((rank, peer), []).append((action, key))
            else:
                at = position.get(peer, {}).get(key)
                if at is None:
                    raise ScheduleError(f"rank {rank}'s {action} waits for {key} from rank {peer}, "
                                        "which never sends it")
                channel = orders[peer]
                while posted[peer] <= at:
                    earlier = channel[posted[peer]]
                    batches.setdefault((peer, rank), []).append((_receive_of(earlier), earlier))
                    posted[peer] += 1
            index += 1
        posts[first] = tuple(
            Batch(src if dst == rank else dst, src == rank, tuple(a for a, _ in items), tuple(k for _, k in items))
            for (src, dst), items in batches.items()
        )
    return tuple(posts)


def place_all_posts(lowered: Schedule, discipline: str, *, forward: int = FORWARD,
                   receives_ahead: int = RECEIVES_AHEAD) -> list[RankPosts]:
    """:func:`place_posts` of every rank."""
    return [place_posts(lowered, rank, discipline, forward=forward, receives_ahead=receives_ahead)
            for rank in range(lowered.num_ranks)]


def posted_programs(lowered: Schedule, posts: Sequence[RankPosts]) -> Schedule:
    """``lowered`` as its ranks move data under ``posts``: each SEND where its batch is posted, each
    RECV where the rank waits for it (with the batch it came in: a wait ends when its whole batch is
    in), compute where it stands. Posting never blocks, so the engine's rule for a lowered program (a
    receive waits for its send) is the rule of these; raises ScheduleError for a wait on a receive
    that was never posted, or a transfer posted twice or not at all.
    """
    programs = []
    for rank, (program, rank_posts) in enumerate(zip(lowered.programs, posts)):
        out: list[Action] = []
        pending: dict[Action, tuple[Action, ...]] = {}  # a posted receive -> its batch's receives
        sent: set[Action] = set()
        waited: set[Action] = set()  # received with an earlier wait of their batch
        for action, batches in zip(program, rank_posts):
            for batch in batches:
                if batch.sends:
                    out.extend(batch.actions)
                    sent.update(batch.actions)
                else:
                    pending.update(dict.fromkeys(batch.actions, batch.actions))
            if action.kind is K.RECV_F or action.kind is K.RECV_B:
                if action in waited:
                    continue
                if action not in pending:
                    raise ScheduleError(f"rank {rank} waits at {action} for a receive it never posted")
                for receive in pending[action]:
                    if pending.pop(receive, None) is not None:
                        out.append(receive)
                        waited.add(receive)
            elif action.kind is K.SEND_F or action.kind is K.SEND_B:
                if action not in sent:
                    raise ScheduleError(f"rank {rank} reaches {action} before any post sends it")
            else:
                out.append(action)
        if len(out) != len(program):
            raise ScheduleError(f"rank {rank}'s posts move {len(out)} actions' worth, its program has "
                                f"{len(program)}: a transfer is posted twice or a posted receive never waited for")
        programs.append(tuple(out))
    return lowered.with_programs(programs)


def check_posts(lowered: Schedule, discipline: str, *, forward: int = FORWARD,
                posts: Sequence[RankPosts] | None = None) -> str | None:
    """None if every rank's posts (``posts``, else :func:`place_all_posts`) complete; else what goes wrong.

    Under :data:`IN_ORDER` each channel's receives must be posted in the order its sends
    are; then the n-th receive meets the n-th send and completes once that send is posted,
    which is a receive's need in the engine. So the posts are stepped by the engine
    (:func:`posted_programs`): a rank stuck there is a rank stuck on the wire.
    """
    if posts is None:
        try:
            posts = place_all_posts(lowered, discipline, forward=forward)
        except ScheduleError as error:
            return str(error)
    if discipline == IN_ORDER:
        mismatch = _channel_mismatch(posts)
        if mismatch:
            return mismatch
    try:
        posted = posted_programs(lowered, posts)
    except ScheduleError as error:
        return str(error)
    stuck = stuck_ranks(posted)
    if not stuck:
        return None
    return "; ".join(f"rank {b.rank} waits at {b.action} (its move #{b.position}) for {b.waits_for}" for b in stuck)


def _channel_mismatch(posts: Sequence[RankPosts]) -> str | None:
    sends: dict[tuple[int, int], list[TransferKey]] = {}
    receives: dict[tuple[int, int], list[TransferKey]] = {}
    for rank, rank_posts in enumerate(posts):
        for batches in rank_posts:
            for batch in batches:
                if batch.sends:
                    sends.setdefault((rank, batch.peer), []).extend(batch.keys)
                else:
                    receives.setdefault((batch.peer, rank), []).extend(batch.keys)
    for channel in sorted(set(sends) | set(receives)):
        if sends.get(channel, []) != receives.get(channel, []):
            src, dst = channel
            return (f"rank {src} sends rank {dst} {sends.get(channel, [])}, but rank {dst} receives "
                    f"{receives.get(channel, [])}")
    return None
