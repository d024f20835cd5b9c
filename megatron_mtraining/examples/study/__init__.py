"""The small-scale study of issue 23, "Does sparse training keep quality?":
``python -m megatron_mtraining.examples.study <stage>``, one command per stage.

1. ``data``: real text that ships with the machine (the standard library, installed
   packages' sources) and generated long documents (the evaluation's task formats,
   passkey / copy / filler), a byte-level BPE, and the indexed datasets of each training
   stage and of the held-out text (``data.py``, ``configs/data/study.yaml``);
2. ``pretrain``: a small Qwen2-shaped model trained dense from scratch at a short length
   (``configs/study/pretrain.yaml``);
3. ``continue --attention {dense,mtraining,msa} --seed N``: that model continued at a long
   length, the same data in the same order for every type (``configs/study/continue.yaml``);
4. ``eval``: the evaluation harness on a run's checkpoint, with its own attention and the
   others where cheap (``--eval`` on stages 2 and 3 does it in the same command);
5. ``report``: every run's evaluation as markdown tables for ``docs/accuracy.md``, and plots.

Stages run in one workdir (``runs.py`` has its layout); ``--export DIR`` packs a stage's
outputs into parts of at most 15 MiB and ``--import`` / ``import`` unpacks them elsewhere
(``transfer.py``), so consecutive stages can run on different machines.
"""
