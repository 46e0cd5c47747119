"""Tiny transformers mixture-of-experts models cut into hand-built stages that keep the original names.

:func:`tiny_moe` builds a Mixtral or a Qwen3-MoE (4 experts, 2 per token, 4 query heads over 2
key/value heads) from its config; :class:`MoEStage` holds some of its decoder layers, by their
original names (``model.layers.3.mlp.experts.gate_up_proj``), the embedding on the first stage and
the norm and head on the last. The stages run the model's own modules, the experts module
included (untraced: its forward is what expert parallelism replaces). Each stage carries every
router's logits so far to the last stage, whose loss adds ``router_aux_loss_coef`` x the model's
own load-balancing loss over all of them (the pattern of Mixtral's ``output_router_logits``).

Example:
    >>> model = tiny_moe("mixtral", 2)                                  # doctest: +SKIP
    >>> stages = [MoEStage(model, [0], first=True), MoEStage(model, [1], last=True)]  # doctest: +SKIP
"""

from __future__ import annotations

import torch
from torch import nn

MOE_VOCAB = 64
AUX_COEFFICIENT = 0.02  # configs/moe.yaml's


def tiny_moe(family: str, num_layers: int, seed: int = 0) -> nn.Module:
    """A tiny ``family`` ("mixtral" or "qwen3_moe") causal LM with 4 experts, 2 per token, grouped K/V heads."""
    import transformers

    sizes = dict(num_hidden_layers=num_layers, hidden_size=32, intermediate_size=32, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=MOE_VOCAB, max_position_embeddings=32, use_cache=False,
                 num_experts_per_tok=2, router_aux_loss_coef=AUX_COEFFICIENT, output_router_logits=True)
    if family == "mixtral":
        model_class, config = transformers.MixtralForCausalLM, transformers.MixtralConfig(
            **sizes, num_local_experts=4)
    else:
        model_class, config = transformers.Qwen3MoeForCausalLM, transformers.Qwen3MoeConfig(
            **sizes, num_experts=4, moe_intermediate_size=32, head_dim=8, norm_topk_prob=True)
    torch.manual_seed(seed)
    return model_class(config).train()


class AddAuxiliaryLoss(torch.autograd.Function):
    """DeepSeek-V3's: the output is the input; backward gives the auxiliary loss a gradient of one."""

    @staticmethod
    def forward(ctx, hidden: torch.Tensor, loss: torch.Tensor) -> torch.Tensor:
        ctx.dtype, ctx.needs = loss.dtype, loss.requires_grad
        return hidden

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        return grad, torch.ones((), dtype=ctx.dtype, device=grad.device) if ctx.needs else None


class MoEStage(nn.Module):
    """Decoder layers ``layers`` of ``model`` (its own modules, shared), embedding first, norm and head last.

    ``aux="carried"``: inputs token ids (first) or (hidden, router logits so far); outputs (hidden or
    LM logits, router logits so far, [layers x tokens, experts]), for :func:`moe_loss`. ``"attached"``:
    each layer's load-balancing loss (its own router logits) attached to its output by
    :class:`AddAuxiliaryLoss`, DeepSeek-V3's way; one tensor in and out, for :func:`lm_loss_only`.
    """

    def __init__(self, model: nn.Module, layers: list[int], first: bool = False, last: bool = False,
                 aux: str = "carried") -> None:
        super().__init__()
        self.model = nn.Module()
        self.model.layers = nn.ModuleDict({str(i): model.model.layers[i] for i in layers})
        self.model.rotary_emb = model.model.rotary_emb
        if first:
            self.model.embed_tokens = model.model.embed_tokens
        if last:
            self.model.norm = model.model.norm
            self.lm_head = model.lm_head
        self.first, self.last, self.aux = first, last, aux
        self.num_experts, self.top_k = _num_experts(model), model.config.num_experts_per_tok

    def forward(self, *inputs: torch.Tensor) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func

        carried = self.aux == "carried"
        hidden = self.model.embed_tokens(inputs[0]) if self.first else inputs[0]
        logits = [inputs[1]] if carried and not self.first else []
        positions = torch.arange(hidden.shape[1], device=hidden.device)[None]
        rotary = self.model.rotary_emb(hidden, positions)
        for layer in self.model.layers.values():
            # The router's logits, as the model's own output recorder takes them (the gate's first output).
            handle = layer.mlp.gate.register_forward_hook(lambda _m, _i, out: logits.append(out[0]))
            try:
                hidden = layer(hidden, position_embeddings=rotary, position_ids=positions)  # causal, no mask
            finally:
                handle.remove()
            if not carried:
                balance = load_balancing_loss_func((logits.pop(),), self.num_experts, self.top_k)
                hidden = AddAuxiliaryLoss.apply(hidden, AUX_COEFFICIENT * balance)
        if self.last:
            hidden = self.lm_head(self.model.norm(hidden))
        return (hidden, torch.cat(logits)) if carried else hidden


def _num_experts(model: nn.Module) -> int:
    config = model.config
    return getattr(config, "num_local_experts", None) or config.num_experts


def moe_stages(model: nn.Module, num_stages: int, aux: str = "carried") -> list[MoEStage]:
    """``model`` cut into ``num_stages`` stages of equal numbers of layers."""
    per = len(model.model.layers) // num_stages
    return [MoEStage(model, list(range(s * per, (s + 1) * per)), first=s == 0, last=s == num_stages - 1, aux=aux)
            for s in range(num_stages)]


def lm_loss_only(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Next-token cross-entropy (the auxiliary losses reach the backward by their autograd Function)."""
    return nn.functional.cross_entropy(output[:, :-1].reshape(-1, output.shape[-1]), target[:, 1:].reshape(-1))


def moe_loss(output: tuple[torch.Tensor, torch.Tensor], target: torch.Tensor, num_experts: int = 4,
             top_k: int = 2) -> torch.Tensor:
    """Next-token cross-entropy plus the coefficient times the model's own load-balancing loss."""
    from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func

    logits, router_logits = output
    language = nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), target[:, 1:].reshape(-1))
    return language + AUX_COEFFICIENT * load_balancing_loss_func((router_logits,), num_experts, top_k)


def traced_moe_loss(output, target: torch.Tensor) -> torch.Tensor:
    """:func:`moe_loss` of the unchanged model's own output (a traced pipeline's last stage gives it): its
    logits and every layer's router logits, carried there from the stages that made them."""
    return moe_loss((output.logits, torch.cat(output.router_logits)), target)
