"""Rank functions of the tensor-parallel checkpoint test: a tiny GPT-2 saved at pp=2 x tp=2, loaded elsewhere.

GPT-2 holds every kind of TP placement: column shards (``mlp.c_fc``), row shards (``c_proj``),
packed q|k|v shards (``attn.c_attn``, torch's ``_StridedShard``), replicated norms, and a tied
embedding (``transformer.wte`` on stage 0, ``lm_head`` on the last stage). Every value a rank
returns is whole (``full_tensor()``, a collective over its TP group), keyed by the tensor's first
name, so that layouts compare with ``torch.equal``.
"""

from __future__ import annotations

from types import MappingProxyType

import torch
from torch.distributed.device_mesh import init_device_mesh

import conveyor
import conveyor.checkpoint as ckpt
from conveyor.errors import CheckpointMismatchError
from conveyor.microbatch import split_microbatches
from conveyor.options import PipelineOptions, SplitOptions, TransferOptions
from conveyor.runtime.stage.device import torch_threads
from conveyor.testing.models import gpt2, token_batch
from conveyor.testing.references.data_parallel import full_tensor

MICROBATCHES = 4
LAYERS = 4  # one layer a stage at pp=4, two at pp=2
# The name the last stage holds -> the tensor's first name.
TIED = MappingProxyType({"lm_head.weight": "transformer.wte.weight"})


def build_model(seed: int = 0, **config_fields) -> torch.nn.Module:
    model_class, config = gpt2(num_layers=LAYERS)
    config.update(config_fields)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return model_class(config).train()


def batch(step: int) -> dict[str, torch.Tensor]:
    return token_batch(batch=2 * MICROBATCHES, length=12, seed=step)


def _pipeline(mesh, seed: int, data_parallel: str | None = None):
    example = next(kwargs for _, kwargs in split_microbatches((), batch(0), MICROBATCHES))
    tensor_parallel = "auto" if "tp" in mesh.mesh_dim_names else None
    return conveyor.pipeline(build_model(seed), example_kwargs=example, schedule="1f1b", microbatches=MICROBATCHES,
                             loss_fn=lambda output, target: output.loss,
                             options=PipelineOptions(split=SplitOptions(method="uniform"),
                                                     transfer=TransferOptions(timeout_s=120)),
                             layout=conveyor.DistributedLayout(mesh=mesh, data_parallel=data_parallel,
                                                               tensor_parallel=tensor_parallel))


def _optimizer(pipe) -> torch.optim.AdamW:
    return torch.optim.AdamW(pipe.parameters(), lr=1e-2, weight_decay=0.1)


def _steps(pipe, optimizer, first: int, count: int) -> list[torch.Tensor]:
    losses = []
    for step in range(first, first + count):
        losses.append(pipe.step(**batch(step)))
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return losses


def held(pipe, optimizer) -> tuple[dict, dict]:
    """This rank's parameters and AdamW state, whole, by each tensor's first name (same order on TP peers)."""
    params, states = {}, {}
    for name, param in pipe.named_parameters():
        params[TIED.get(name, name)] = full_tensor(param)
        if optimizer is not None and optimizer.state.get(param):
            states[TIED.get(name, name)] = {k: full_tensor(v) for k, v in optimizer.state[param].items()}
    return params, states


def save_resume_and_reshard(rank: int, world_size: int, paths: dict[str, str]) -> dict:
    """On 4 ranks. pp=2 x tp=2: 2 steps, save; 2 more; save again, with the logits; a new pp=2 x tp=2
    pipeline and optimizer load the first checkpoint and run the same 2 steps again. Then the first
    checkpoint loaded at pp=4 and at pp=2 x dp=2 (ddp), each saved again."""
    torch.set_num_threads(1)
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "tp"))
    pipe = _pipeline(mesh, seed=0)
    optimizer = _optimizer(pipe)
    _steps(pipe, optimizer, 0, 2)
    ckpt.save(paths["step_2"], pipe, optimizer, extra={"step": 2})
    saved = held(pipe, optimizer)
    want = _steps(pipe, optimizer, 2, 2)
    ckpt.save(paths["step_4"], pipe, optimizer, extra={"step": 4})
    logits = pipe.forward(**batch(9))  # traced in train mode; every dropout is 0
    want_after = held(pipe, optimizer)
    pipe.close()

    pipe = _pipeline(mesh, seed=3)  # a new job: other values until loaded, an optimizer with no state
    optimizer = _optimizer(pipe)
    extra = ckpt.load(paths["step_2"], pipe, optimizer)
    loaded = held(pipe, optimizer)
    got = _steps(pipe, optimizer, 2, 2)
    got_after = held(pipe, optimizer)
    pipe.close()
    result = {
        "extra": extra, "saved": saved, "resumed": loaded,
        "resume_losses": (want, got), "resume_after": (want_after, got_after),
        "logits": None if logits is None else full_tensor(logits.logits),
    }
    result["pp4"] = _load_at(init_device_mesh("cpu", (4,), mesh_dim_names=("pp",)), None, paths, "pp4")
    result["dp2"] = _load_at(init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "dp")), "ddp", paths, "dp2")
    return result


def _load_at(mesh, data_parallel: str | None, paths: dict[str, str], name: str) -> tuple[dict, dict]:
    pipe = _pipeline(mesh, seed=7, data_parallel=data_parallel)  # other values until loaded
    optimizer = _optimizer(pipe)
    assert ckpt.load(paths["step_2"], pipe, optimizer) == {"step": 2}
    loaded = held(pipe, optimizer)
    if name in paths:
        ckpt.save(paths[name], pipe, optimizer, extra={"step": 2})
    pipe.close()
    return loaded


def load_at_pp1_tp2(rank: int, world_size: int, paths: dict[str, str]) -> dict:
    """On 2 ranks: the pp=2 x tp=2 checkpoint loaded by one stage split over tp=2; then, into the same
    pipeline and a fresh optimizer, the one saved at pp=4; then a checkpoint of a wider GPT-2, refused."""
    torch.set_num_threads(1)
    pipe = _pipeline(init_device_mesh("cpu", (1, 2), mesh_dim_names=("pp", "tp")), seed=8)
    results = {"sharded": sorted(n for n, p in pipe.named_parameters()
                                 if any(not pl.is_replicate() for pl in getattr(p, "placements", ())))}
    for name in ("step_2", "pp4"):
        optimizer = _optimizer(pipe)
        assert ckpt.load(paths[name], pipe, optimizer) == {"step": 2}
        results[name] = held(pipe, optimizer)
    try:
        ckpt.load(paths["wider"], pipe, optimizer)
    except CheckpointMismatchError as error:
        results["refusal"] = str(error)
    results["after refusal"] = held(pipe, optimizer)  # unchanged: the refusal came before any read
    _steps(pipe, optimizer, 2, 1)  # and the pipeline still trains
    pipe.close()
    return results


def trace_once_here() -> None:
    """Trace the model once in the test process, so that forked ranks find torch.export warmed up."""
    import conveyor.frontend as frontend

    example = next(kwargs for _, kwargs in split_microbatches((), batch(0), MICROBATCHES))
    frontend.split_model(build_model(), 2, example_kwargs=example, split_method="uniform")


def exported_logits(directory):
    """The logits of the Hugging Face model exported to ``directory`` on the test batch, at the ranks'
    thread count (CPU reductions depend on it)."""
    from transformers import AutoModelForCausalLM

    with torch_threads(1):
        model = AutoModelForCausalLM.from_pretrained(directory).eval()
        with torch.no_grad():
            return model(**batch(9)).logits
