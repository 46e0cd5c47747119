"""Where a pipeline runs: the stage device, and the device each backend communicates on.

Everything a rank computes lives on one device, the *stage device*: the stage modules, the
activations and gradients it receives, the loss, the norms and every buffer the runtime
makes, and the batches a data loader hands it. By default it is this process's GPU when CUDA
is available (:func:`local_gpu`: ``LOCAL_RANK``'s among the GPUs this process sees), else the
CPU. What crosses between ranks travels on the device the backend needs: the stage's GPU with
NCCL, the CPU with gloo (:func:`collective_device`, :func:`group_device`); the executor moves
payloads between the two only where they differ, so the CPU path copies nothing. A GPU stage
device is made the current CUDA device (:func:`make_current`) before anything communicates,
whatever the backend: NCCL, FSDP2 and the object collectives all work on the current device.

Example:
    >>> resolve_device("cpu")
    device(type='cpu')
    >>> to_device((torch.ones(2), {"n": 3}), torch.device("cpu"))[1]
    {'n': 3}
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch.utils import _pytree as pytree

from conveyor.errors import PipelineConfigError

log = logging.getLogger(__name__)

_CPU = torch.device("cpu")


def local_gpu(environ: Mapping[str, str] | None = None, warn: bool = True) -> torch.device:
    """This process's GPU: ``cuda:<LOCAL_RANK mod the GPUs it sees>``; without ``LOCAL_RANK``, the current one.

    A launcher that gives each process its own GPU (``CUDA_VISIBLE_DEVICES`` set to one device per
    process) leaves each process one GPU to see, ``cuda:0``, whatever its ``LOCAL_RANK``; torchrun
    over every GPU gives ``LOCAL_RANK`` < the GPU count. More local ranks than GPUs share them
    round-robin (logged when ``warn``): fine over gloo, refused by NCCL, which takes one GPU per rank.

    Example (a launcher that gave this process GPU 3 alone, as ``cuda:0``):
        >>> from unittest import mock
        >>> with mock.patch("torch.cuda.device_count", return_value=1):
        ...     local_gpu({"LOCAL_RANK": "3", "CUDA_VISIBLE_DEVICES": "3"})
        device(type='cuda', index=0)
    """
    environ = os.environ if environ is None else environ
    count = torch.cuda.device_count()
    if count < 1:
        raise PipelineConfigError("this process sees no CUDA device (torch.cuda.device_count() is 0); "
                                  "pass device='cpu', or check CUDA_VISIBLE_DEVICES")
    raw = environ.get("LOCAL_RANK", "")
    if not raw.isdigit():
        return torch.device("cuda", torch.cuda.current_device())
    local_rank = int(raw)
    index = local_rank % count
    visible = [d for d in environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if d.strip()]
    own = count == 1 and len(visible) == 1  # the launcher gave this process one GPU of its own
    if warn and local_rank >= count and not own:
        log.warning("conveyor: LOCAL_RANK=%d but this process sees %d CUDA device(s): it runs on cuda:%d, which "
                    "other local ranks share (fine over gloo; NCCL needs one GPU per rank: launch at most %d "
                    "process(es) per node, or give each its own GPU with CUDA_VISIBLE_DEVICES)",
                    local_rank, count, index, count)
    return torch.device("cuda", index)


def resolve_device(device: torch.device | str | None = None) -> torch.device:
    """The stage device ``device`` names; None: :func:`local_gpu` when CUDA is available, else CPU.

    ``"cuda"`` without an index is this process's GPU too (:func:`local_gpu`), not ``cuda:0`` on
    every rank. Raises :class:`PipelineConfigError` for a name torch does not know, the meta
    device, or a device this machine does not have, saying which exist.

    Example:
        >>> resolve_device(None) if not torch.cuda.is_available() else torch.device("cpu")
        device(type='cpu')
    """
    if device is None:
        return local_gpu() if torch.cuda.is_available() else _CPU
    try:
        resolved = torch.device(device)
    except (RuntimeError, TypeError) as exc:
        raise PipelineConfigError(
            f"device={device!r} is not a device torch knows ({exc}); pass e.g. 'cpu', 'cuda' or 'cuda:1', "
            "or leave it out (this process's GPU when CUDA is available, else cpu)"
        ) from None
    if resolved.type == "meta":
        raise PipelineConfigError(
            "device='meta' holds no data, so a pipeline cannot run there; pass the device to run on "
            "(conveyor.pipeline materialises a meta-device model's stages on it)"
        )
    if resolved.type == "cuda":
        if not torch.cuda.is_available():
            raise PipelineConfigError(f"device={device!r} is a CUDA device, but CUDA is not available here "
                                      "(torch.cuda.is_available() is False); pass device='cpu'")
        if resolved.index is None:
            return local_gpu()
        count = torch.cuda.device_count()
        if resolved.index >= count:
            raise PipelineConfigError(
                f"device={device!r} names cuda:{resolved.index}, but this process sees {count} CUDA device(s) "
                f"(cuda:0..cuda:{count - 1}); pass one of those, or 'cuda' (this process's GPU)"
            )
        return resolved
    backend = getattr(torch, resolved.type, None)
    is_available = getattr(backend, "is_available", None)
    if resolved.type != "cpu" and callable(is_available) and not is_available():
        raise PipelineConfigError(f"device={device!r}: torch.{resolved.type} is not available on this machine; "
                                  "pass device='cpu' or run where that device exists")
    return resolved


def collective_device(backend: str, device: torch.device) -> torch.device:
    """Where ``backend``'s collectives and messages take their tensors: NCCL the stage's GPU, others the CPU.

    Example:
        >>> collective_device("gloo", torch.device("cpu")), collective_device("nccl", torch.device("cuda", 1))
        (device(type='cpu'), device(type='cuda', index=1))

    Raises :class:`PipelineConfigError` for NCCL with a stage device that is not a GPU: NCCL
    carries CUDA tensors only, and the loss, norms and flags travel from the stage device.
    """
    if backend != "nccl":
        return _CPU
    if device.type != "cuda":
        raise PipelineConfigError(
            f"the process group's backend 'nccl' carries CUDA tensors only, but the pipeline's device {device} "
            "is not a GPU; pass device='cuda:<LOCAL_RANK>' (or leave device out), or init the process group "
            "with 'gloo' to run on the CPU"
        )
    return device


def group_device(device: torch.device, group: Any = None) -> torch.device:
    """Where a collective on ``group`` (None: the default group) takes the tensors of a rank whose
    stage device is ``device``: :func:`collective_device` of the group's backend.

    Example (on a gloo group)::

        total = totals.to(group_device(pipe.device))
        dist.all_reduce(total)
    """
    return collective_device(str(dist.get_backend(group)), device)


def make_current(device: torch.device) -> torch.device:
    """Make a GPU stage device the current CUDA device (nothing for other devices); returns it.

    NCCL builds its communicators, runs the object collectives of start-up and checkpoints, and
    FSDP2 and ``replicate`` place their parameters, on the *current* device, whatever the backend
    (gloo, or the ``cpu:gloo,cuda:nccl`` of a backend-less ``init_process_group()``): a script
    that never called ``torch.cuda.set_device`` would otherwise put every rank of a node on ``cuda:0``.

    Example:
        >>> make_current(torch.device("cpu"))  # a CPU stage: nothing to do
        device(type='cpu')
    """
    if device.type == "cuda" and device.index is not None and torch.cuda.current_device() != device.index:
        torch.cuda.set_device(device)
    return device


def place_modules(modules: Iterable[torch.nn.Module] | torch.nn.Module, stages: Iterable[int],
                  device: torch.device) -> torch.device:
    """Put every stage module on ``device`` and return it: a module on the CPU is moved there (in
    place, its Parameter objects kept); one with a tensor on another device (meta: not
    materialised, or another accelerator) is an error naming the stage, the tensor and both devices.

    Example:
        >>> layer = torch.nn.Linear(2, 2)
        >>> place_modules([layer], [0], torch.device("cpu")), layer.weight.device
        (device(type='cpu'), device(type='cpu'))
    """
    for module, stage in zip([modules] if isinstance(modules, torch.nn.Module) else modules, stages):
        move = False
        for name, tensor in [*module.named_parameters(), *module.named_buffers()]:
            if tensor.device == device:
                continue
            if tensor.device.type == "cpu":
                move = True
                continue
            fix = ("materialise it first, e.g. module.to_empty(device=...) then load or initialise its weights "
                   "(conveyor.pipeline does this: it builds each rank's stages on the device)"
                   if tensor.device.type == "meta" else
                   f"move it with module.to({str(device)!r}), or pass device={str(tensor.device)!r} to run there")
            raise PipelineConfigError(
                f"stage {stage}: {name!r} is on {tensor.device}, but the pipeline's device is {device}; {fix}"
            )
        if move:
            module.to(device)
    return device


def to_device(value: Any, device: torch.device) -> Any:
    """``value`` with every tensor on ``device`` (those already there untouched). A moved tensor is a
    fresh leaf that requires grad where the original did: what a stage receives from a peer.

    Example:
        >>> x = torch.ones(2, requires_grad=True)
        >>> to_device(x, torch.device("cpu")) is x
        True
    """
    def moved(tensor: torch.Tensor) -> torch.Tensor:
        return tensor if tensor.device == device else tensor.detach().to(device).requires_grad_(tensor.requires_grad)

    return moved(value) if isinstance(value, torch.Tensor) else pytree.tree_map_only(torch.Tensor, moved, value)


def module_device(modules: Iterable[torch.nn.Module]) -> torch.device | None:
    """The device of the first parameter or buffer of ``modules`` that holds data (None when none
    does: a meta tensor says where nothing is, and placing such a stage names it).

    Example:
        >>> module_device([torch.nn.Linear(2, 2, device="meta"), torch.nn.Linear(2, 2)])
        device(type='cpu')
    """
    for module in modules:
        for tensor in [*module.parameters(), *module.buffers()]:
            if tensor.device.type != "meta":
                return tensor.device
    return None


def cpu_threads_per_rank(local_ranks: int, environ: dict[str, str] | None = None, cores: int | None = None) -> int:
    """The CPU threads each of ``local_ranks`` ranks on this host computes with: ``OMP_NUM_THREADS``
    when set, else the host's cores shared among them (at least 1). Training and planning on the
    CPU use the same count, so that a unit profiled for a plan runs as fast as it will in a rank.

    Example:
        >>> cpu_threads_per_rank(2, {}, cores=2), cpu_threads_per_rank(2, {"OMP_NUM_THREADS": "3"}, cores=2)
        (1, 3)
    """
    environ = os.environ if environ is None else environ
    if environ.get("OMP_NUM_THREADS", "").isdigit() and int(environ["OMP_NUM_THREADS"]) > 0:
        return int(environ["OMP_NUM_THREADS"])
    if cores is None:
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, cores // max(1, local_ranks))


@contextlib.contextmanager
def torch_threads(count: int | None) -> Iterator[None]:
    """torch's intra-op threads set to ``count`` for the block (None: unchanged), then put back.

    Example:
        >>> with torch_threads(1):
        ...     torch.get_num_threads()
        1
    """
    if count is None:
        yield
        return
    previous = torch.get_num_threads()
    torch.set_num_threads(count)
    try:
        yield
    finally:
        torch.set_num_threads(previous)
