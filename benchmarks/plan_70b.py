"""How long `conveyor.plan` takes for a 64-stage plan of a 70B-parameter Llama (issue 21, item 5).

The model is built on the meta device (nothing allocated), its units costed from their shapes
(conveyor.plan.analytic: 4e14 FLOP/s, bf16), and every schedule x microbatch count x V searched
for 64 ranks of 80 GiB with a global batch of 512 sequences of 4096 tokens.

    PYTHONPATH=. .venv/bin/python benchmarks/plan_70b.py [--ranks 64] [--global-batch 512]
"""

from __future__ import annotations

import argparse
import time


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=64)
    parser.add_argument("--global-batch", type=int, default=512)
    parser.add_argument("--seq-len", type=int, default=4096)
    parser.add_argument("--memory-per-rank", default="80GiB")
    args = parser.parse_args()

    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from conveyor.plan import format_plan
    from conveyor.plan.planner import plan

    started = time.perf_counter()
    config = LlamaConfig(hidden_size=8192, intermediate_size=28672, num_hidden_layers=80, num_attention_heads=64,
                         num_key_value_heads=8, vocab_size=128256, max_position_embeddings=args.seq_len,
                         tie_word_embeddings=False, torch_dtype=torch.bfloat16)
    with torch.device("meta"):
        model = LlamaForCausalLM(config).to(torch.bfloat16)
    built = time.perf_counter()
    example = torch.zeros(1, args.seq_len, dtype=torch.long)
    chosen = plan(model, example, ranks=args.ranks, global_batch=args.global_batch,
                  memory_per_rank=args.memory_per_rank)
    done = time.perf_counter()
    parameters = sum(p.numel() for p in model.parameters())
    print(f"Llama {parameters / 1e9:.1f}B parameters, {args.ranks} ranks, global batch {args.global_batch} x "
          f"{args.seq_len} tokens, {args.memory_per_rank} per rank")
    print(format_plan(chosen))
    print(f"model built in {built - started:.2f} s; planned in {done - built:.2f} s")


if __name__ == "__main__":
    main()
