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
                             schedule="1f1b", microbatches=2, loss_fn=_loss,
                             options=conveyor.PipelineOptions(transfer=conveyor.TransferOptions(timeout_s=60)))
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


_W = torch.randn(5, 5, generator=torch.Generator().manual_seed(0))


class _Embed(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Linear(5, 5, bias=False)
        self.emb.weight.data.copy_(_W)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.emb(x))


class _Head(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.head = nn.Linear(5, 5, bias=False)
        self.head.weight.data.copy_(_W)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.head(h)


def _mse(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return (out - target).pow(2).mean()


def _steps(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(4, 5, generator=generator), torch.randn(4, 5, generator=generator)


def _accumulate_over_steps(rank, world_size, transport):
    from types import SimpleNamespace

    import conveyor.schedule as cs

    tied = [SimpleNamespace(uses=[(0, "emb.weight"), (1, "head.weight")])]
    module = [_Embed(), _Head()][rank]
    pipe = conveyor.Pipeline([module], schedule=cs.build("1f1b", ranks=2, microbatches=2), loss_fn=_mse,
                             transfer=conveyor.TransferOptions(transport=transport, timeout_s=60),
                             model=conveyor.WholeModel(tied_parameters=tied))
    grads = []
    for step in range(3):  # no zero_grad: the user accumulates over steps
        x, y = _steps(step)
        pipe.step(x, target=y)
        grads.append(next(module.parameters()).grad.clone())
    return grads


def test_a_tied_gradient_accumulated_over_steps_counts_each_step_once():
    weight = nn.Parameter(_W.clone())
    want = []
    for step in range(3):
        x, y = _steps(step)
        for xi, yi in zip(x.tensor_split(2), y.tensor_split(2)):
            (_mse(torch.tanh(xi @ weight.t()) @ weight.t(), yi) / 2).backward()
        want.append(weight.grad.clone())
    for transport in ("process_group", "shared_memory"):
        for rank_grads in run_ranks(_accumulate_over_steps, 2, args=(transport,), timeout_s=120):
            for step, (got, expected) in enumerate(zip(rank_grads, want, strict=True)):
                # Summed across ranks in another order than one device sums: equal to rounding.
                torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6, msg=f"{transport}, step {step}")
