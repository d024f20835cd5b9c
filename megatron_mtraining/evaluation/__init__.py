"""Long-context evaluation: RULER-style synthetic tasks and loss by position, on any model
given as a function, and on a training checkpoint through ``python -m megatron_mtraining.evaluate``.

| module | one job |
|---|---|
| `tasks.py` | the task generators (seeded, exact length in tokens) and their exact solvers |
| `held_out.py` | held-out long-document windows: an indexed dataset, or synthetic documents |
| `harness.py` | the plan, teacher-forced scoring, the greedy check, loss by position, the results dict |
| `report.py` | JSON, markdown tables, plots, TensorBoard / W&B logging |
| `megatron_model.py` | a checkpoint loaded into the plugin's GPT, run under the config's parallelism |
"""
