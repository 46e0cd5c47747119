"""Hugging Face models from their default configs (``use_cache=True``): traced with the cache off.

Training never reads the key/value cache and torch.export cannot return it, so the model is
traced with its config's ``use_cache`` off, the config put back afterwards, and one log line
says so. The stages are bitwise equal to the model called with ``use_cache=False``.
"""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch
from torch import nn

import conveyor.frontend as frontend
from conveyor.testing.models import default_causal_lm, token_batch
from conveyor.testing.references.unsplit import check_parity

TRACE_LOGGER = "conveyor.frontend.trace"
README = Path(__file__).resolve().parents[2] / "README.md"


def cache_off_messages(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [
        record.getMessage()
        for record in caplog.records
        if record.name == TRACE_LOGGER and "use_cache=False" in record.getMessage()
    ]


@pytest.mark.parametrize("name", ["gpt2", "llama", "qwen2"])
def test_default_config_splits_with_the_cache_off_and_matches_eager(name, caplog):
    model_class, config = default_causal_lm(name)
    assert config.use_cache is True  # the default this test is about
    torch.manual_seed(0)
    model = model_class(config).train()
    batch = token_batch()

    with caplog.at_level(logging.INFO, logger=TRACE_LOGGER):
        split = frontend.split_model(model, 2, example_kwargs=batch, split_method="uniform")
    assert cache_off_messages(caplog) == [
        f"tracing {model_class.__name__} with use_cache=False (training never uses the "
        "key/value cache, which torch.export cannot return; the model's config is left as it is)"
    ]
    assert model.config.use_cache is True
    # README says at which level the line is logged (by default Python shows WARNING and above only).
    levels = {r.levelname for r in caplog.records if r.name == TRACE_LOGGER and "use_cache=False" in r.getMessage()}
    assert levels == {"INFO"} and "a log line at INFO says so" in README.read_text()

    # Stage 0 takes the batch as the model does, with no use_cache; the reference is the model
    # called as it was traced (eager GPT-2 with its cache on differs in gradient rounding).
    check_parity(model, split, kwargs=batch, seed=3, reference_kwargs={"use_cache": False})
    assert model.config.use_cache is True


class CausalLMWithOwnLoss(nn.Module):
    """A user's wrapper around a Hugging Face model: its config is found inside."""

    def __init__(self, inner: nn.Module):
        super().__init__()
        self.inner = inner

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        logits = self.inner(input_ids=input_ids).logits
        return logits[:, :-1].logsumexp(-1).mean()


def test_wrapped_model_is_traced_with_the_cache_off(caplog):
    model_class, config = default_causal_lm("llama")
    torch.manual_seed(0)
    model = CausalLMWithOwnLoss(model_class(config))
    ids = token_batch()["input_ids"]
    with caplog.at_level(logging.INFO, logger=TRACE_LOGGER):
        split = frontend.split_model(
            model, 2, example_args=(ids,), split_points=["inner.model.layers.1"]
        )
    (message,) = cache_off_messages(caplog)
    assert message.startswith("tracing LlamaForCausalLM with use_cache=False")
    assert model.inner.config.use_cache is True
    # The eager reference keeps its cache on (the wrapper takes no use_cache): for Llama, the
    # same arithmetic.
    check_parity(model, split, args=(ids,), loss_fn=lambda loss: loss)


def test_use_cache_false_passed_by_the_user_is_kept_without_a_log_line(caplog):
    model_class, config = default_causal_lm("gpt2")
    torch.manual_seed(0)
    model = model_class(config).eval()
    batch = {**token_batch(), "use_cache": False}
    with caplog.at_level(logging.INFO, logger=TRACE_LOGGER):
        split = frontend.split_model(model, 2, example_kwargs=batch)
    assert cache_off_messages(caplog) == []
    assert "use_cache" in [spec.name for spec in split.stage_input_specs(0)]
    check_parity(model, split, kwargs=batch)
