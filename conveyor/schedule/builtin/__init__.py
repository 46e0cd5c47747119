"""Built-in schedules, one per module; importing this registers them all.

| name              | stages per rank      | source                                          |
| ----------------- | -------------------- | ----------------------------------------------- |
| gpipe             | 1                    | Huang et al., NeurIPS 2019                      |
| 1f1b              | 1                    | Narayanan et al., ICML 2021 (PipeDream-Flush)   |
| interleaved-1f1b  | any V (default 2)    | Narayanan et al., SC 2021 (Megatron-LM)         |
| looped-bfs        | any V (default 2)    | Lamy-Poirier, MLSys 2023                        |
| zb-h1, zb-h2      | any V (default 1)    | Qi et al., ICLR 2024                            |
| zbv               | 2, V-shaped          | Qi et al., ICLR 2024 (arXiv version)            |
| dualpipev         | 2, V-shaped          | DeepSeek-AI 2024, deepseek-ai/DualPipe          |
| zb-1p, zb-2p      | 1, searched for costs| Qi et al., ICLR 2024, Section 3 (automatic)     |

Every one serves every P >= 1 and M >= 1.
"""

# ruff: noqa: I001, F401 - imported for their register() calls, simplest first: the
# registry (and so `conveyor schedules`) lists them in import order.
from conveyor.schedule.builtin import gpipe
from conveyor.schedule.builtin import one_f_one_b
from conveyor.schedule.builtin import interleaved_1f1b
from conveyor.schedule.builtin import looped_bfs
from conveyor.schedule.builtin import zb_h1
from conveyor.schedule.builtin import zb_h2
from conveyor.schedule.builtin import zbv
from conveyor.schedule.builtin import dualpipev
from conveyor.schedule.builtin import zb_auto
