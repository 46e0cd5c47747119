"""Expert parallelism on one device: 2 gloo ranks sharing it (pp=1 x dp=2, ep=2), against EP alone; and its
all-to-alls overlapped in a schedule's pairs: 4 gloo ranks sharing it (pp=2 x dp=2, ep=2), against the plain step.

Each rank keeps 2 of a tiny Mixtral's 4 experts per layer; its tokens reach the other rank's experts
by all-to-all over gloo (device tensors through the host). EP alone runs the unpiped model, its
experts sharded alike, on the same ranks and device. Losses, step-1 gradients and the parameters
after 3 AdamW steps must be bitwise equal.

Example::

    ok, detail = experts_row(Context(torch.device("cpu"), quick=True, compile=False))
"""

from __future__ import annotations

import torch

from .common import Context, compare, cpu, deterministic, launch


def _experts_rank(rank: int, world: int, device: str) -> dict:
    from torch.distributed.device_mesh import init_device_mesh

    import conveyor
    import conveyor.schedule as cs
    from conveyor.testing.models.moe import MoEStage, moe_loss, tiny_moe
    from conveyor.testing.references.experts import MICROBATCHES, _train, batches, train_ep_alone

    device = torch.device(device)
    deterministic(device)
    mesh = init_device_mesh(device.type, (1, 2), mesh_dim_names=("pp", "dp"))
    dp_rank = mesh.get_local_rank("dp")
    want = train_ep_alone("mixtral", 2, mesh["dp"].get_group(), dp_rank, device=str(device))
    stage = MoEStage(tiny_moe("mixtral", 2), [0, 1], first=True, last=True)
    schedule = cs.build("gpipe", ranks=1, microbatches=MICROBATCHES)
    ids = [x.to(device) for x in batches(dp_rank)]
    with conveyor.Pipeline([stage], schedule, loss_fn=moe_loss, transfer=conveyor.TransferOptions(timeout_s=120),
                           layout=conveyor.DistributedLayout(mesh=mesh, expert_parallel="auto",
                                                             ep=2, device=device)) as pipe:
        got = _train(pipe.named_parameters(), lambda step: pipe.step(ids[step], target=ids[step]), lambda: None)
    return cpu({"got": got, "want": want})


def experts_row(ctx: Context) -> tuple[bool, str]:
    """EP over 2 gloo ranks on one device: losses, step-1 grads and params bitwise EP alone's."""
    ranks = launch(_experts_rank, 2, ctx, timeout_s=300)
    for rank, result in enumerate(ranks):
        (losses, grads, params), (want_losses, want_grads, want_params) = result["got"], result["want"]
        for what, got, want in (("loss ", dict(enumerate(losses)), dict(enumerate(want_losses))),
                                ("step-1 grad ", grads, want_grads), ("param ", params, want_params)):
            ok, detail = compare(got, want, f"rank {rank} {what}")
            if not ok:
                return ok, detail
    return True, "2 of 4 experts per rank: losses, step-1 grads, params bitwise EP alone on both ranks"


def _overlap_rank(rank: int, world: int, device: str) -> dict:
    from conveyor.testing.references.expert_overlap import overlapped_against_plain

    deterministic(torch.device(device))
    return overlapped_against_plain(rank, world, ("zbv", "dualpipev"), device)


def overlap_row(ctx: Context) -> tuple[bool, str]:
    """``expert_overlap=True`` under zbv and dualpipev (the traced Mixtral, 4 gloo ranks on one device): losses,
    step-1 grads and params bitwise the plain pipeline's, every rank running pairs."""
    ranks = launch(_overlap_rank, 4, ctx, timeout_s=600)
    for rank, by_schedule in enumerate(ranks):
        for name, result in by_schedule.items():
            if not (result["losses equal"] and result["grads equal"] and result["params equal"]):
                return False, f"rank {rank}, {name}: not the plain step's ({', '.join(result['unequal'][:3])})"
    pairs = {name: sum(r[name]["pairs"] for r in ranks) for name in ranks[0]}
    if not all(pairs.values()):
        return False, f"a schedule ran no pair: {pairs}"
    return True, "zbv, dualpipev: losses, step-1 grads, params bitwise the plain step's; pairs " + ", ".join(
        f"{name} {count}" for name, count in pairs.items())
