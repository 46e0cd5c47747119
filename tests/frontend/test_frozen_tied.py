"""A frozen parameter tied across ranks stays frozen: no gradient, so the optimizer skips it."""

from __future__ import annotations

import torch
from torch import nn

import conveyor
from conveyor.testing import run_ranks

IDS = torch.randint(0, 16, (4, 5), generator=torch.Generator().manual_seed(1))


class TiedLM(nn.Module):
    def __init__(self, vocab: int = 16, width: int = 8) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.layers = nn.ModuleList(nn.Linear(width, width) for _ in range(2))
        self.head = nn.Linear(width, vocab, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


def _frozen_model() -> TiedLM:
    torch.manual_seed(0)
    model = TiedLM()
    model.embed.weight.requires_grad_(False)  # frozen embeddings, as in much fine-tuning
    return model


def _loss(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(out.flatten(0, 1), target.flatten())


def _train_one_step(rank, world_size):
    pipe = conveyor.pipeline(_frozen_model(), example_args=(IDS[:2],), split_points=["layers.1"],
                             schedule="1f1b", microbatches=2, loss_fn=_loss, timeout_s=60)
    optimizer = torch.optim.AdamW(pipe.parameters(), lr=0.1)  # weight decay would move a zero grad
    pipe.step(IDS, target=IDS)
    grads = {n: p.grad for n, p in pipe.named_parameters()}
    optimizer.step()
    return grads, {n: p.detach().clone() for n, p in pipe.named_parameters()}


def test_a_frozen_tied_parameter_gets_no_gradient_and_does_not_move():
    reference = _frozen_model()
    optimizer = torch.optim.AdamW(reference.parameters(), lr=0.1)
    for ids in torch.tensor_split(IDS, 2):
        (_loss(reference(ids), ids) / 2).backward()
    assert reference.embed.weight.grad is None
    optimizer.step()
    want = dict(reference.named_parameters())
    results = run_ranks(_train_one_step, 2, timeout_s=120)
    tied = [name for grads, _ in results for name in grads if name in ("embed.weight", "head.weight")]
    assert sorted(tied) == ["embed.weight", "head.weight"]
    for grads, values in results:
        for name in ("embed.weight", "head.weight"):
            if name in grads:
                assert grads[name] is None, name
                assert torch.equal(values[name], want["embed.weight"]), name
