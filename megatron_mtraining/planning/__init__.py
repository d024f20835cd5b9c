"""Capacity planning: predicted seconds per step, throughput, MFU and memory of a run on a
cluster, by part, from measured kernel and step tables (``python -m megatron_mtraining.plan``)."""
