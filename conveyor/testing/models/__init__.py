"""The model zoo: every model the tests and the benchmarks build, in one place.

- :mod:`~conveyor.testing.models.tiny_lm`: a small transformer language model cut into
  stages by hand (stages hand each other a tuple of mixed values), its one-module reference
  and single-device gradient accumulation; the runtime's parity tests, the kill trials and
  the soak train it (``conveyor demo`` trains a recipe model instead: ``configs/demo.yaml``).
- :mod:`~conveyor.testing.models.hf`: tiny Hugging Face causal LMs (GPT-2, Llama, Qwen2;
  configs only, no downloads) and token batches, for the frontend's tracing tests.
- :mod:`~conveyor.testing.models.graphs`: hand-made graphs for the splitter (skips, two
  encoders, plain stacks, blocks of uneven cost).
- :mod:`~conveyor.testing.models.workloads`: the benchmark's workloads (emulated device
  time, from :mod:`conveyor.plan.emulated` where the calibration finds it; tiny stages; a
  small GPT), each a record that builds stage ``s`` of ``n`` with the same weights however
  the model is cut.

Every name is importable from here.

Example:
    >>> import torch
    >>> from conveyor.testing.models import TinyConfig, build_stage
    >>> cfg = TinyConfig(num_stages=2)
    >>> stages = [build_stage(s, cfg) for s in range(2)]
    >>> ids = torch.randint(0, cfg.vocab_size, (4, cfg.seq_len))
    >>> stages[1](*stages[0](ids)).shape
    torch.Size([4, 8, 32])
"""

from conveyor.testing.models.graphs import (
    ResidualMLP,
    SkipNet,
    Stack,
    TextBlock,
    TwoEncoders,
    UnevenMLP,
    two_encoder_batch,
)
from conveyor.testing.models.hf import (
    GROUPED_FAMILIES,
    VOCAB,
    default_causal_lm,
    gpt2,
    grouped_heads_lm,
    llama,
    token_batch,
)
from conveyor.testing.models.tiny_lm import (
    Block,
    ReferenceModel,
    TinyConfig,
    TinyStage,
    build_stage,
    lm_loss,
    make_batch,
    reference_model,
    reference_step,
)
from conveyor.testing.models.workloads import (
    WORKLOADS,
    BlockStack,
    Emulated,
    GPTBlock,
    GPTStage,
    Overhead,
    SleepBlock,
    TinyGPT,
    Workload,
)

__all__ = [
    "GROUPED_FAMILIES",
    "VOCAB",
    "WORKLOADS",
    "Block",
    "BlockStack",
    "Emulated",
    "GPTBlock",
    "GPTStage",
    "Overhead",
    "ReferenceModel",
    "ResidualMLP",
    "SkipNet",
    "SleepBlock",
    "Stack",
    "TextBlock",
    "TinyConfig",
    "TinyGPT",
    "TinyStage",
    "TwoEncoders",
    "UnevenMLP",
    "Workload",
    "build_stage",
    "default_causal_lm",
    "gpt2",
    "grouped_heads_lm",
    "llama",
    "lm_loss",
    "make_batch",
    "reference_model",
    "reference_step",
    "token_batch",
    "two_encoder_batch",
]
