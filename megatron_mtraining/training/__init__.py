"""The training program: ``python -m megatron_mtraining.pretrain`` on Megatron-LM's own
``pretrain``, built on the Megatron adapter (``megatron_mtraining.megatron``).

* ``yaml_config``: the run config (Megatron arguments and the plugin's attention), checked
  before anything starts; ``dry_run``: ``--dry-run``; ``memory``: the memory estimate.
* ``megatron_args``: Megatron's arguments for a run; ``job``: the whole training job
  (:func:`~megatron_mtraining.training.job.run`); ``allocator``: the CUDA allocator setting
  it and the GPU benchmarks run with.
* What Megatron's ``pretrain`` calls back: ``forward_step`` (model provider, batch, forward
  step, loss function), ``datasets``, and ``checkpoint_checks`` before it loads a checkpoint.
* What the steps compute and report: ``chunked_loss`` and ``linear_cross_entropy`` (the loss
  without whole logits), ``attention_metrics`` and ``step_metrics`` (the per-interval
  ``[mtraining]`` line, read back by ``metrics_line``), ``validation_metrics`` (the line of
  each evaluation), ``step_report`` (``--step-report``),
  ``finite_guard`` (``--check-finite``), and ``run_state``, what they share in a process.
"""
