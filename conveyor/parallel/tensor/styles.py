"""torch ``ParallelStyle``s for the layers torch's own styles do not take, built from torch's pieces.

- :class:`TransposedColwiseParallel` / :class:`TransposedRowwiseParallel`: torch's Colwise/Rowwise
  for a layer that stores its weight as ``(in, out)`` (GPT-2's ``Conv1D``); the same input and
  output handling, the weight sharded on its other dim.
- ``packed=3`` shards a fused ``q|k|v`` projection (GPT-2's ``c_attn``; a Linear works too):
  a plain column shard would give TP rank 0 all of q and half of k. Its weight becomes a DTensor
  with torch's ``_StridedShard(dim, split_factor=3)``: each rank holds ``[q_r | k_r | v_r]``, while
  the parameter keeps its name, shape and full-tensor value (``full_tensor()``, a checkpoint's
  value) in the original ``q|k|v`` order. DTensor's ``addmm`` keeps that placement, so the
  module's local output is exactly this rank's heads of q, k and v.
- :class:`LocalBlock`: an attention module's own width attributes (GPT-2's ``split_size``, a
  ``num_heads`` used in ``view``) divided by the TP size, because the module now sees its heads only;
  per-head biases sliced, and the sequence gathered on the way in under sequence parallelism.

Example (on each of 2 ranks)::

    parallelize_module(gpt2_block, tp_mesh, {
        "attn": LocalBlock(("split_size",)),
        "attn.c_attn": TransposedColwiseParallel(packed=3),
        "attn.c_proj": TransposedRowwiseParallel(),
    })
"""

from __future__ import annotations

import inspect
from functools import partial

from torch import nn
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_module, distribute_tensor
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, RowwiseParallel
from torch.distributed.tensor.placement_types import _StridedShard


def is_transposed_projection(module: nn.Module) -> bool:
    """A leaf that computes ``x @ weight + bias`` with ``weight`` of shape ``(nx, nf)``, as GPT-2's Conv1D."""
    weight = getattr(module, "weight", None)
    return (
        not isinstance(module, nn.Linear) and isinstance(getattr(module, "nx", None), int)
        and isinstance(getattr(module, "nf", None), int) and isinstance(weight, nn.Parameter)
        and tuple(weight.shape) == (module.nx, module.nf)
    )


def column_placement(dim: int, packed: int = 1):
    """A column shard on ``dim``: plain, or strided over ``packed`` equal parts (fused q|k|v)."""
    return Shard(dim) if packed == 1 else _StridedShard(dim, split_factor=packed)


def _distribute(module: nn.Module, name: str, mesh, placement, src_data_rank) -> None:
    param = getattr(module, name, None)
    if param is None:
        return
    module.register_parameter(name, nn.Parameter(
        distribute_tensor(param, mesh, [placement], src_data_rank=src_data_rank),
        requires_grad=param.requires_grad,
    ))


def _check_transposed(style: ParallelStyle, module: nn.Module) -> None:
    if not is_transposed_projection(module):
        raise TypeError(f"{type(style).__name__} takes a Conv1D-like layer (a weight laid out (in, out), as "
                        f"GPT-2's), got {type(module).__name__}: give an nn.Linear torch's own "
                        f"ColwiseParallel/RowwiseParallel")


def _local_output(use_local_output: bool, mod, outputs, device_mesh):
    # The output already holds this rank's columns (plain or packed): hand them on as they are.
    return outputs.to_local() if use_local_output else outputs


class PackedColwiseParallel(ColwiseParallel):
    """torch's ColwiseParallel for a Linear whose output packs ``packed`` equal parts (fused q|k|v).

    Example::

        parallelize_module(attention, tp_mesh, {"qkv_proj": PackedColwiseParallel(packed=3)})
    """

    _weight_dim = 0  # the weight's output dim, sharded

    def __init__(self, *, packed: int = 3, use_local_output: bool = True) -> None:
        super().__init__(use_local_output=use_local_output)
        self.packed = packed

    def _partition(self, name, module, device_mesh) -> None:
        _distribute(module, "weight", device_mesh, column_placement(self._weight_dim, self.packed), self.src_data_rank)
        _distribute(module, "bias", device_mesh, column_placement(0, self.packed), self.src_data_rank)

    def _apply(self, module: nn.Module, device_mesh) -> nn.Module:
        return distribute_module(
            module, device_mesh, self._partition,
            partial(self._prepare_input_fn, self.input_layouts, self.desired_input_layouts),
            partial(_local_output, self.use_local_output),
        )


class TransposedColwiseParallel(PackedColwiseParallel):
    """torch's ColwiseParallel for a ``(in, out)`` weight (GPT-2's Conv1D); ``packed=3`` for fused q|k|v.

    Example::

        parallelize_module(gpt2_mlp, tp_mesh, {"c_fc": TransposedColwiseParallel()})
    """

    _weight_dim = 1

    def __init__(self, *, packed: int = 1, use_local_output: bool = True) -> None:
        super().__init__(packed=packed, use_local_output=use_local_output)

    def _apply(self, module: nn.Module, device_mesh) -> nn.Module:
        _check_transposed(self, module)
        return super()._apply(module, device_mesh)

    def __repr__(self) -> str:
        return f"{type(self).__name__}(packed={self.packed}, use_local_output={self.use_local_output})"


class TransposedRowwiseParallel(RowwiseParallel):
    """torch's RowwiseParallel for a ``(in, out)`` weight (GPT-2's Conv1D): weight rows sharded, bias replicated.

    Example::

        parallelize_module(gpt2_mlp, tp_mesh, {"c_proj": TransposedRowwiseParallel()})
    """

    def _partition(self, name, module, device_mesh) -> None:
        _distribute(module, "weight", device_mesh, Shard(0), self.src_data_rank)
        _distribute(module, "bias", device_mesh, Replicate(), self.src_data_rank)

    def _apply(self, module: nn.Module, device_mesh) -> nn.Module:
        _check_transposed(self, module)
        self.desired_input_layouts = (Shard(-1),)
        return distribute_module(
            module, device_mesh, self._partition,
            partial(self._prepare_input_fn, self.input_layouts, self.desired_input_layouts),
            partial(self._prepare_output_fn, self.output_layouts, self.use_local_output),
        )


class LocalBlock(ParallelStyle):
    """What an attention or MLP block sees on its TP rank; its parameters are left to its projections' styles.

    - ``attributes``: integer widths the block's forward uses (head counts in ``view``, GPT-2's
      ``split_size``), divided by the TP size: the block computes its rank's heads only;
    - ``head_inputs``: keyword inputs holding one bias per head (MPT's ALiBi ``position_bias``,
      ``[heads, ...]``, built for all heads by the model), sliced to this rank's heads;
    - ``gather_sequence``: under sequence parallelism the block's first input arrives as a
      DTensor sharded on the sequence; it is gathered (torch's ``redistribute``) and handed to
      the block as a whole local tensor, positional or keyword alike (torch's
      ``PrepareModuleInput`` needs to know which, and Hugging Face blocks differ).

    Example::

        parallelize_module(attention, tp_mesh, {"attn": LocalBlock(("n_heads",), ("position_bias",))})
    """

    def __init__(self, attributes: tuple[str, ...] = (), head_inputs: tuple[str, ...] = (),
                 gather_sequence: bool = False) -> None:
        super().__init__()
        self.attributes = tuple(attributes)
        self.head_inputs = tuple(head_inputs)
        self.gather_sequence = gather_sequence

    def _apply(self, module: nn.Module, device_mesh) -> nn.Module:
        size = device_mesh.size()
        for name in self.attributes:
            value = getattr(module, name)
            if value % size:
                raise ValueError(f"{name}={value} of {type(module).__name__} is not divisible by tp={size}")
            setattr(module, name, value // size)
        if self.head_inputs or self.gather_sequence:
            first = next(iter(inspect.signature(module.forward).parameters))
            module.register_forward_pre_hook(
                partial(_block_inputs, self, first, device_mesh.get_local_rank(), size), with_kwargs=True
            )
        return module

    def __repr__(self) -> str:
        return (f"LocalBlock({self.attributes}, head_inputs={self.head_inputs}, "
                f"gather_sequence={self.gather_sequence})")


def _block_inputs(style: LocalBlock, first: str, rank: int, size: int, module, args, kwargs):
    for name in style.head_inputs:
        value = kwargs.get(name)
        if value is not None and not isinstance(value, DTensor):
            kwargs[name] = value.chunk(size, dim=0)[rank]
    if style.gather_sequence:
        if args and isinstance(args[0], DTensor):
            args = (args[0].full_tensor(), *args[1:])
        elif isinstance(kwargs.get(first), DTensor):
            kwargs[first] = kwargs[first].full_tensor()
    return args, kwargs

