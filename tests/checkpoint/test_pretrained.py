"""Hugging Face weights per stage (each rank reads its own tensors), and export back to transformers.

A tiny GPT-2 (tied ``lm_head`` / ``wte``) is saved with ``save_pretrained`` in shards; a pp=4
pipeline of the model built on the meta device loads it rank by rank, gives the logits of
``from_pretrained`` bitwise, trains a step and saves a checkpoint; ``conveyor export`` turns
that checkpoint into files ``from_pretrained`` loads, with the pipeline's logits.
"""

from __future__ import annotations

import json

import pytest
import torch

import conveyor
import conveyor.checkpoint as ckpt
from conveyor.cli import main
from conveyor.errors import PretrainedWeightsError
from conveyor.frontend.pretrained import load_pretrained
from conveyor.testing import run_ranks

pytestmark = pytest.mark.distributed

SPLIT = ["transformer.h.1", "transformer.h.2", "transformer.h.3"]


def _config():
    from transformers import GPT2Config

    return GPT2Config(n_layer=4, n_embd=32, n_head=4, vocab_size=96, n_positions=16, resid_pdrop=0.0,
                      embd_pdrop=0.0, attn_pdrop=0.0, use_cache=False, bos_token_id=0, eos_token_id=0)


def _ids():
    return torch.randint(0, 96, (4, 12), generator=torch.Generator().manual_seed(3))


def _logits_of(directory):
    from transformers import AutoModelForCausalLM

    previous = torch.get_num_threads()
    torch.set_num_threads(1)  # the ranks' count: CPU reductions depend on it
    try:
        model = AutoModelForCausalLM.from_pretrained(directory).eval()
        with torch.no_grad():
            return model(_ids()).logits
    finally:
        torch.set_num_threads(previous)


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    from transformers import GPT2LMHeadModel

    torch.manual_seed(0)
    directory = tmp_path_factory.mktemp("gpt2")
    GPT2LMHeadModel(_config()).save_pretrained(directory, max_shard_size="30KB")
    return directory


def _pipeline_from_pretrained(rank, world_size, hf_dir, ckpt_dir):
    from transformers import GPT2LMHeadModel

    with torch.device("meta"):
        model = GPT2LMHeadModel(_config())
    ids = _ids()
    pipe = conveyor.pipeline(model, example_args=(ids[:2],), split_points=SPLIT, schedule="1f1b",
                             microbatches=2, loss_fn=lambda out, labels: out.loss,
                             example_kwargs={"labels": ids[:2]},
                             options=conveyor.PipelineOptions(transfer=conveyor.TransferOptions(timeout_s=60)))
    report = pipe.load_pretrained(hf_dir)
    share = sum(t.numel() * t.element_size() for r in pipe.runners.values() for t in r.module.state_dict().values())
    pretrained_logits = pipe(ids, labels=ids)  # traced in train mode; every dropout is 0
    optimizer = torch.optim.AdamW(pipe.parameters(), lr=1e-2)
    pipe.step(ids, labels=ids)
    optimizer.step()
    ckpt.save(ckpt_dir, pipe, optimizer, extra={"step": 1})
    trained_logits = pipe(ids, labels=ids)
    logits = [None if out is None else out.logits for out in (pretrained_logits, trained_logits)]
    return report, share, logits


def test_each_rank_reads_its_own_tensors_and_export_round_trips(hf_dir, tmp_path):
    index = json.loads((hf_dir / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    assert len(files) > 2 and "lm_head.weight" not in index["weight_map"]  # sharded; the tie saved once
    results = run_ranks(_pipeline_from_pretrained, 4, args=(str(hf_dir), str(tmp_path / "ckpt")), timeout_s=180)
    total = sum((hf_dir / f).stat().st_size for f in files)
    for rank, (report, share, _) in enumerate(results):
        assert report.bytes_read == share, f"rank {rank} read {report.bytes_read} bytes, its stages hold {share}"
        assert report.total_bytes == total and report.bytes_read < total / 2
        print(f"rank {rank}: read {report.bytes_read} of {total} bytes from {len(report.files)} of "
              f"{len(files)} files")
    assert any(len(report.files) < len(files) for report, _, _ in results)  # not every file on every rank
    pretrained, trained = results[-1][2]
    assert torch.equal(pretrained, _logits_of(hf_dir))  # the pipeline = from_pretrained, bitwise

    out = tmp_path / "exported"
    assert main(["export", str(tmp_path / "ckpt"), str(out), "--max-shard-size", "40KB"]) == 0
    exported = json.loads((out / "model.safetensors.index.json").read_text())["weight_map"]
    assert "lm_head.weight" not in exported and "transformer.wte.weight" in exported
    assert json.loads((out / "config.json").read_text())["architectures"] == ["GPT2LMHeadModel"]
    assert torch.equal(_logits_of(out), trained)
    assert ckpt.export(tmp_path / "ckpt", tmp_path / "single") == ["model.safetensors"]
    assert torch.equal(_logits_of(tmp_path / "single"), trained)


def test_weights_of_another_model_are_refused_by_name_and_shape(hf_dir, tmp_path):
    from transformers import GPT2Config, GPT2LMHeadModel

    wider = GPT2LMHeadModel(GPT2Config(**{**_config().to_dict(), "n_embd": 64}))
    with pytest.raises(PretrainedWeightsError, match=r"'transformer.wte.weight' has shape \[96, 64\] in the model "
                                                      r"but \[96, 32\]"):
        load_pretrained(hf_dir, [wider], [("transformer.wte.weight", "lm_head.weight")])
    deeper = GPT2LMHeadModel(GPT2Config(**{**_config().to_dict(), "n_layer": 5}))
    with pytest.raises(PretrainedWeightsError, match=r"'transformer.h.4.ln_1.weight' \(shape \[32\]\) is in none"):
        load_pretrained(hf_dir, [deeper], [("transformer.wte.weight", "lm_head.weight")])
    with pytest.raises(PretrainedWeightsError, match="no safetensors weights"):
        load_pretrained(tmp_path, [deeper])


def test_a_stage_on_the_meta_device_gets_real_tensors_in_place(hf_dir):
    from safetensors import safe_open

    with torch.device("meta"):
        stage = torch.nn.Linear(32, 96, bias=False)
    held = stage.weight  # what an optimizer built already would hold
    report = load_pretrained(hf_dir, [torch.nn.ModuleDict({"lm_head": stage})],
                             [("transformer.wte.weight", "lm_head.weight")])
    assert stage.weight is held and not held.is_meta and isinstance(held, torch.nn.Parameter)
    where = json.loads((hf_dir / "model.safetensors.index.json").read_text())["weight_map"]["transformer.wte.weight"]
    with safe_open(hf_dir / where, framework="pt") as f:
        assert torch.equal(stage.weight, f.get_tensor("transformer.wte.weight"))
    assert report.files == [where] and report.bytes_read == 96 * 32 * 4
