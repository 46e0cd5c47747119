"""Split an unchanged ``nn.Module`` into pipeline stages that keep the original names.

How it works: the model is traced once with ``torch.export`` (non-strict, training
IR) on one example microbatch, giving every ATen operation eager mode runs, in
execution order, each tagged with the modules it ran inside, and every parameter
and buffer with its original name. A cut "before module X" starts a stage at X's
first operation; values still needed later (skip connections, ``labels``,
``attention_mask``) are passed through the stages in between, so stage i only ever
talks to stage i+1. Each stage runs exactly the operations the unsplit model runs,
so outputs and gradients are bitwise equal to it (``run_sequential`` checks this).

Limits of tracing (all reported with the module and source line that failed):

* shapes and non-tensor inputs are fixed to the example microbatch's (stage 0
  raises ``SpecMismatchError`` on anything else: split again for another shape);
* Python branching on tensor values (``if x.sum() > 0``, ``.item()``) cannot be traced;
* outputs must be tensors, plain values and pytrees of them (tuple, list, dict,
  Hugging Face ``ModelOutput``). A Hugging Face key/value cache is none of these and
  training never uses it, so Hugging Face models are traced with ``use_cache`` off
  (the model's config is left as it is) unless ``example_kwargs`` sets ``use_cache``;
* devices met while tracing (``torch.arange(..., device=x.device)``) are recorded;
  a stage built on another device (a meta-device model, a cpu model built on cuda)
  has them rewritten to its own device. Composite ops such as dropout and
  ``scaled_dot_product_attention`` stay whole in the graph and pick their kernel when
  they run, as in eager (checked on cpu only);
* the train/eval mode is fixed when tracing: a stage in the other mode refuses to
  run; ``split.with_mode(training=False)`` traces the same cut for evaluation;
* ``unsplittable`` only keeps cuts out of a module; it does not change tracing
  (no opaque leaf modules): code that cannot be traced must be made traceable, or
  the stages built by hand (any modules following the stage call convention work
  with ``run_sequential`` and the pipeline).

Tensors: stages hold the model's own tensors where they can (no copy), a copy of
every tensor used by several stages (tied embeddings; the pipeline sums the copies'
gradients, see ``ModelSplit.tied_groups``), and, for a meta-device model, only their
own tensors, allocated and initialised on the stage's device (see
``conveyor.frontend.materialize``).

Example:
    >>> import torch
    >>> import conveyor.frontend as frontend
    >>> model = torch.nn.Sequential(*[torch.nn.Linear(8, 8) for _ in range(4)])
    >>> x = torch.randn(2, 8)
    >>> split = frontend.split_model(model, 2, example_args=(x,))
    >>> out = frontend.run_sequential(split.stage_modules(), (x,))
    >>> torch.equal(out, model(x))
    True
"""

from conveyor.errors import SplitError, TracingError
from conveyor.frontend.sequential import run_sequential
from conveyor.frontend.split import SPLIT_METHODS, ModelSplit, TiedParameter, split_model
from conveyor.frontend.stage import StageModule, ValueSpec

__all__ = [
    "SPLIT_METHODS",
    "SplitError",
    "ModelSplit",
    "StageModule",
    "TiedParameter",
    "TracingError",
    "ValueSpec",
    "run_sequential",
    "split_model",
]
