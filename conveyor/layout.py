"""Where a pipeline's ranks are, the ``layout=`` of :class:`conveyor.Pipeline` and :func:`conveyor.pipeline`:
:class:`InProcessLayout` or :class:`DistributedLayout`, whose type chooses the ranks backend. Like the records
of :mod:`conveyor.options` each is frozen, checks itself when made and gives the ranks its :meth:`describe`.

Example:
    >>> DistributedLayout(dp=2).describe()
    'the default group, dp=2 tp=1 data_parallel=None tensor_parallel=None sequence_parallel=False loss_parallel=False
    expert_parallel=None ep=None expert_capacity=None expert_overlap=False'
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from conveyor.errors import PipelineConfigError, positive_int
from conveyor.expert_option import check_expert_parallel
from conveyor.options import _f, _set

DATA_PARALLEL_KINDS = ("ddp", "fsdp")


@dataclass(frozen=True)
class InProcessLayout:
    """Every rank of the pipeline in this process, one thread, with the numerics of the distributed
    pipeline bit for bit (for debugging and fast tests).

    Example:
        >>> InProcessLayout(ranks=2).describe()
        'every rank in this process'
    """

    ranks: int | None = _f(None, "how many ranks (None: the modules over the schedule's stages per rank)")
    device: Any = _f(None, "the stages' device (None: where the modules are)")

    def __post_init__(self) -> None:
        ranks = self.ranks
        if ranks is not None and not positive_int(ranks):
            raise PipelineConfigError(f"InProcessLayout.ranks takes a positive number of ranks or None; got {ranks!r}")

    def describe(self) -> str:
        """What the ranks compare (in one process: nothing that differs)."""
        return "every rank in this process"


@dataclass(frozen=True)
class DistributedLayout:
    """Where a distributed pipeline's ranks are, and what each dim of the job's mesh does.

    The job's ranks form a ("pp", "dp", "tp") mesh, pp outermost, tp innermost: ranks along "pp"
    run one pipeline; ``dp`` replicas of it share gradients the ``data_parallel`` way; each stage's
    ``tp`` ranks split it the ``tensor_parallel`` way, each talking to the matching TP rank of the
    neighbouring stages. Give the sizes (the pipeline builds the mesh over the job's ranks with
    :func:`conveyor.parallel.mesh.pipeline_mesh`) or a ``mesh`` (its sizes are read from it); ``group``
    gives one pipeline its own ranks among the job's; neither: the default group is the pipeline. A new dim
    is one size field naming it (``mesh_dim``), which the checks, describe() and with_mesh read with no more
    code; :data:`conveyor.parallel.mesh.MESH_DIMS` says where it goes in the mesh. ``parts``: your StageParts.

    Example:
        >>> DistributedLayout(tp=2).tensor_parallel   # tp ranks split each stage by its structure
        'auto'
        >>> DistributedLayout(group=object(), dp=2)  # doctest: +NORMALIZE_WHITESPACE
        Traceback (most recent call last):
        ...
        conveyor.errors.PipelineConfigError: DistributedLayout(group=...) is one pipeline's ranks, with no
        replicas or tensor-parallel ranks; give dp= and tp= (or mesh=) without group=
    """

    group: Any = _f(None, "a torch.distributed ProcessGroup: the pipeline's ranks (None: the default group); "
                          "the pipeline communicates on groups of its own over them")
    mesh: Any = _f(None, "a DeviceMesh with a 'pp' dim and any of 'dp', 'tp' (pp outermost, tp innermost; "
                         "conveyor.parallel.mesh.pipeline_mesh); None: built from dp and tp when either is above 1")
    device: Any = _f(None, "the stages' device (None or 'cuda': this process's GPU when CUDA is available, else "
                           "the CPU)")
    dp: int = _f(1, "replicas of the pipeline (the mesh's 'dp' size; read from mesh= when given)", mesh_dim="dp")
    tp: int = _f(1, "tensor-parallel ranks per stage (the mesh's 'tp' size; read from mesh= when given)",
                 mesh_dim="tp")
    data_parallel: str | None = _f(None, "ddp (the default with dp > 1) | fsdp: how replicas share gradients")
    tensor_parallel: Any = _f(None, "how each stage splits over its tp ranks (conveyor.parallel.tensor): 'auto' "
                                    "(the plan found by the modules' structure; the default with tp > 1) or "
                                    "{module-name pattern: torch ParallelStyle}")
    sequence_parallel: bool = _f(False, "with tensor_parallel='auto': activations between blocks on sequence "
                                        "shards, and sent between stages so (hand-built and traced stages)")
    loss_parallel: bool = _f(False, "with tensor_parallel: logits stay vocabulary-sharded and the last stage's "
                                    "loss runs under torch's loss_parallel() (hand-built or traced stages)")
    expert_parallel: Any = _f(None, "experts sharded over ep of the dp x tp ranks (conveyor.parallel.experts): "
                                    "'auto' or {module-name pattern: 'ep_dispatch_experts'}; None: off")
    ep: int | None = _f(None, "with expert_parallel: ranks per expert group, dividing dp x tp (None: dp); "
                              "borrowed from the replicas and their TP ranks, so not a dim of its own")
    expert_capacity: float | None = _f(None, "with expert_parallel: a capacity factor; each expert takes at most "
                                             "ceil(factor x routed slots / experts) of a rank's slots per microbatch "
                                             "and layer, the later ones in token order dropped; None: none dropped")
    expert_overlap: bool = _f(False, "with expert_parallel: each forward paired with the backward next to it in a "
                                     "rank's program, each running while the other's all-to-alls are in flight "
                                     "(conveyor.parallel.experts.overlap); the same numbers")
    parts: tuple = _f((), "StageParts of your own (conveyor.parallel.part), after the built-in ones")

    def __post_init__(self) -> None:
        self._check_sizes()
        if self.data_parallel is not None and self.data_parallel not in DATA_PARALLEL_KINDS:
            raise PipelineConfigError(f"data_parallel must be 'ddp', 'fsdp' or None; got {self.data_parallel!r}")
        self._check_tensor_parallel()
        check_expert_parallel(self)

    def _check_sizes(self) -> None:
        """dp and tp: positive sizes, read from a mesh when one is given; a group is one pipeline alone."""
        if self.group is not None and self.mesh is not None:
            raise PipelineConfigError("give the pipeline mesh= or group=, not both (mesh['pp'] is its group)")
        dims = tuple(getattr(self.mesh, "mesh_dim_names", None) or ())
        for name in self.mesh_dims():
            size = getattr(self, name)
            if not positive_int(size):
                raise PipelineConfigError(f"DistributedLayout.{name} takes a positive number of ranks; got {size!r}")
            if self.group is not None and size != 1:
                raise PipelineConfigError("DistributedLayout(group=...) is one pipeline's ranks, with no replicas or "
                                          "tensor-parallel ranks; give dp= and tp= (or mesh=) without group=")
            given = self.mesh.size(dims.index(name)) if name in dims else size
            if size not in (1, given):
                raise PipelineConfigError(f"DistributedLayout({name}={size}) but the mesh's {name!r} dim has "
                                          f"{given} ranks; give the mesh alone (its sizes are read from it)")
            _set(self, name, given)  # frozen: normalised here (the mesh's size where it has the dim)

    def _check_tensor_parallel(self) -> None:
        """tensor_parallel goes with tp > 1 ('auto' when not given); the plan holds ParallelStyles (the
        same checks on every rank, before any communication)."""
        if self.tensor_parallel is None and self.tp > 1:
            # Frozen, normalised here: tp ranks that each ran the whole stage would do its work tp times.
            _set(self, "tensor_parallel", "auto")
        plan = self.tensor_parallel
        for name in ("sequence_parallel", "loss_parallel"):
            if not isinstance(getattr(self, name), bool):
                raise PipelineConfigError(f"DistributedLayout.{name} takes True or False; got "
                                          f"{getattr(self, name)!r}")
            if getattr(self, name) and plan is None:
                raise PipelineConfigError(f"{name}=True is part of tensor parallelism: give tp > 1 (or a mesh with "
                                          "a 'tp' dim), or drop it")
        if plan is not None and not (plan == "auto" if isinstance(plan, str) else isinstance(plan, Mapping)):
            raise PipelineConfigError(f"tensor_parallel takes 'auto' or a dict {{module-name pattern: torch "
                                      f"ParallelStyle}} (None: off); got {plan!r}")
        if isinstance(plan, Mapping):
            from torch.distributed.tensor.parallel import ParallelStyle  # only here: DTensor is heavy to import

            for pattern, style in plan.items():
                if not isinstance(pattern, str) or not isinstance(style, ParallelStyle):
                    raise PipelineConfigError(
                        f"the tensor-parallel plan maps {pattern!r} to {type(style).__name__}; it takes module-name "
                        "patterns to torch ParallelStyles (ColwiseParallel(), RowwiseParallel(), ...)")
            if not plan:
                raise PipelineConfigError("tensor_parallel={} is an empty plan: give 'auto', a plan, or None (off)")
        if self.sequence_parallel and plan != "auto":
            raise PipelineConfigError("sequence_parallel=True goes with tensor_parallel='auto' (a plan of your own "
                                      "says itself where activations are sequence-sharded: use SequenceParallel())")
        dims = tuple(getattr(self.mesh, "mesh_dim_names", None) or ())
        if plan is not None and self.tp == 1 and "tp" not in dims:
            where = f"a mesh with dims {dims}" if self.mesh is not None else "a pipeline without tp ranks"
            raise PipelineConfigError(
                f"tensor_parallel={describe_plan(plan)} needs tensor-parallel ranks, got {where}: give tp= (the "
                "ranks per stage), or a mesh with a 'tp' dim (tp innermost): "
                "mesh=init_device_mesh(device, (pp, tp), mesh_dim_names=('pp', 'tp'))")
        # (A mesh without "pp" is refused by conveyor.parallel.mesh.layout_of, saying so.)

    @classmethod
    def mesh_dims(cls) -> tuple[str, ...]:
        """The size fields, one per mesh dim besides "pp" (whose size is what the others leave of the job)."""
        return tuple(f.name for f in dataclasses.fields(cls) if "mesh_dim" in f.metadata)

    def describe(self) -> str:
        """What the ranks compare: where, then every other field but the device (which differs by rank), stably."""
        where = "a mesh" if self.mesh is not None else "a group" if self.group is not None else "the default group"
        fields = [f"{f.name}={describe_plan(getattr(self, f.name))}" for f in dataclasses.fields(self)
                  if f.name not in ("group", "mesh", "device", "parts")]
        parts = f", parts {[type(part).__name__ for part in self.parts]}" if self.parts else ""
        return f"{where}, {' '.join(fields)}{parts}"


# Where a pipeline's ranks are: the one record or the other (Pipeline's backend follows the record's type).
Layout = InProcessLayout | DistributedLayout


def describe_plan(plan: Any) -> str:
    """A tensor-parallel plan as the ranks compare it: 'auto', or each pattern and its style's type, sorted.

    Example:
        >>> from torch.distributed.tensor.parallel import ColwiseParallel
        >>> describe_plan({"mlp.fc": ColwiseParallel()})
        "{'mlp.fc': ColwiseParallel}"
    """
    if not isinstance(plan, Mapping):
        return repr(plan)
    return "{" + ", ".join(f"{pattern!r}: {type(style).__name__}" for pattern, style in sorted(plan.items())) + "}"
