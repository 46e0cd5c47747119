"""Whether NCCL can block a rank's *host* forever in a first step, given where it posts.

The data's completion under order matching is the schedule layer's to prove
(:func:`conveyor.schedule.posts.check_posts`, stepped by the engine). NCCL adds what blocks
the host rather than the stream, which only a first step meets: a receive whose structure
is not known yet waits for its sender to publish it, and a communicator created at a
channel's first use waits for both its ranks. This replay keeps a loop of its own because
its waits are not the engine's (a need per transfer's structure and per channel, met at
posts, not at actions).

Example:
    >>> import conveyor.schedule as cs
    >>> from conveyor.schedule.posts import IN_ORDER, place_all_posts
    >>> lowered = cs.executable(cs.build("zb-h1", ranks=3, microbatches=4, virtual=2)).train
    >>> posts = place_all_posts(lowered, IN_ORDER)
    >>> check_first_step(lowered, posts, lazy_communicators=True) is None
    False
    >>> check_first_step(lowered, posts, lazy_communicators=False) is None
    True
"""

from __future__ import annotations

from collections.abc import Sequence

from conveyor.schedule.ir import Schedule
from conveyor.schedule.posts import RankPosts, TransferKey


def check_first_step(lowered: Schedule, posts: Sequence[RankPosts], *, lazy_communicators: bool,
                     structures_known: bool = False) -> str | None:
    """None if no rank's host blocks forever in a first step under NCCL; else who waits for what.

    What blocks the host, as NCCL does it (a wait on a NCCL work orders the stream and
    returns; posting returns at once):

    - **structure**: posting a receive whose structure is not known yet (the first time that
      transfer happens, not given in ``TransferOptions(shapes=...)``) waits until the sender reached
      the post that sends it (it publishes the structure there, before posting);
    - **communicator** (``lazy_communicators``): a channel's communicator is created at the
      first operation on it, and creating it (``ncclCommInitRank``) blocks until both its ranks
      reached their first post on that channel (after the structure waits of that post).

    ``structures_known``: every structure was given (or a step already ran). A rank that
    blocks on neither runs its program to the end, so the host cannot deadlock.
    """
    # Per rank, its posts in program order: (channel (src, dst), sends?, keys).
    events = [[((rank, b.peer) if b.sends else (b.peer, rank), b.sends, b.keys)
               for batches in rank_posts for b in batches] for rank, rank_posts in enumerate(posts)]
    published: set[TransferKey] = set()
    created = set() if lazy_communicators else {channel for mine in events for channel, _, _ in mine}
    arrived: dict[tuple[int, int], set[int]] = {}
    at = [0] * len(events)
    blocked: dict[int, str] = {}
    moved = True
    while moved:
        moved = False
        for rank, mine in enumerate(events):
            while at[rank] < len(mine):
                channel, sending, keys = mine[at[rank]]
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
    if all(at[rank] == len(mine) for rank, mine in enumerate(events)):
        return None
    return "; ".join(f"rank {rank} blocks at its post #{at[rank]}, waiting for {blocked[rank]}"
                     for rank in sorted(blocked))



