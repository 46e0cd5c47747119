"""Checkpoints of pipelines: save, load into any layout, export, and pretrained weights per stage.

Tensors are written with ``torch.distributed.checkpoint`` (DCP) under the unsplit model's
names, so a checkpoint saved with pp=4 under 1f1b loads with pp=2 under zbv, with pp=1, or
into the plain model. Tensor-parallel stages save their DTensor shards by the same names, and
load into any pp, dp and tp. Everything else is JSON; nothing pickled is ever loaded.

Example (on every rank)::

    conveyor.checkpoint.save("ckpt/step_100", pipe, optimizer, lr_scheduler=scheduler,
                             extra={"step": 100}, keep_last=3)
    extra = conveyor.checkpoint.load("ckpt/step_100", pipe, optimizer, lr_scheduler=scheduler)
    state = conveyor.checkpoint.to_state_dict("ckpt/step_100")     # one process, unsplit names
    pipe.load_pretrained("path/to/hf_model_dir")                     # each rank reads its tensors

and ``conveyor export CHECKPOINT_DIR OUT_DIR`` writes safetensors (+ config.json) that
``transformers.AutoModelForCausalLM.from_pretrained(OUT_DIR)`` loads.
"""

# The function shadows its module's name on the package: imported here, before anything else can.
from conveyor.checkpoint.export import export
from conveyor.checkpoint.files import checkpoints, latest
from conveyor.checkpoint.loading import check, load, to_state_dict
from conveyor.checkpoint.saving import save
from conveyor.frontend.pretrained import PretrainedReport, load_pretrained

__all__ = ["PretrainedReport", "check", "checkpoints", "export", "latest", "load", "load_pretrained", "save",
           "to_state_dict"]

