"""Host reads on the training step's path: each would make the host wait for the GPU's queue
to drain, and the GPU then idles while the host launches what follows (the idle time of
``training/step_report.py``). Counted on CPU tensors (``host_reads.HostReads``, which counts
every read of host memory too, so a count bounds a GPU's), with the Triton kernels in
Triton's interpreter. A new read makes a count here grow: remove it, or name it below."""

import megatron_workers as workers
import pytest
import torch
from gloo import run
from host_reads import HostReads

# Reads the CPU count holds that a GPU's does not: a BlockTopKIndex made in host memory has
# its ids checked there (the builders' ids are in range by construction; on a GPU nothing is
# read). Once per layer and step: the recompute takes the index the forward kept.
HOST_MEMORY_ID_CHECK = 1
# The held-out recall's rows are drawn on the host every logging step, then checked and listed
# (a tolist each) per layer: host memory, nothing waits for the device.
HELDOUT_ROWS = 2
# Packed documents: each micro-batch's boundaries are read on the host once (by its first
# layer), and the vertical-slash build reads its per-document lists' longest width once a
# layer, to cut them (``vertical_slash.cut_vertical``; the recompute takes the kept index).
DOCUMENT_BOUNDS, LIST_WIDTH = 1, 1
# Per layer: the forward (under full recompute, without autograd), the backward (the layer
# again, with its kept index, then its backward) and what a logging step's metrics (attended
# fraction, index recall, held-out recall) add to the forward.
LAYER_READS = {
    "mtraining": {"forward": 0, "backward": 0, "metrics": HELDOUT_ROWS},
    "moba": {"forward": HOST_MEMORY_ID_CHECK, "backward": 0, "metrics": HELDOUT_ROWS},
    "mtraining-docs": {"forward": DOCUMENT_BOUNDS + LIST_WIDTH, "backward": 0, "metrics": HELDOUT_ROWS},
}
ON_A_GPU = "counts the reads of CPU tensors, which stand for a GPU's; on a GPU the layer runs on the CPU"


@pytest.mark.skipif(torch.cuda.is_available(), reason=ON_A_GPU)
@pytest.mark.parametrize("kind", sorted(LAYER_READS))
def test_layer_training_step(kind, monkeypatch):
    """A Megatron layer's training step as ``bench_training.py`` runs it: full recompute, the
    attention on the kernels, and the metrics of a logging step."""
    monkeypatch.setenv("MTRAINING_ATTENTION_BACKEND", "triton")
    run(1, workers.check_layer_host_reads, kind, LAYER_READS[kind])


def test_token_loss_reads_at_the_report_only():
    """The LM loss of each micro-batch is added up on the device: a read would wait for the
    forward, between it and the backward."""
    from megatron_mtraining.training.step_metrics import TokenLoss

    loss = TokenLoss()
    with HostReads() as reads:
        for n in range(3):
            loss.add(torch.tensor(2.5 + n), torch.tensor(7, dtype=torch.int32))
    assert reads.count == 0
    assert loss.sums.tolist() == [10.5, 21.0]


def test_gpu_launches_read_nothing(kdevice, rng):
    """What runs on a GPU in place of a CPU's torch operations, which the layer's count does
    not see on a CPU: the top-p take, the tile tables in one launch, RoPE in one pass, and the
    index build replayed from its CUDA graph (captured by the first build)."""
    from megatron_mtraining.megatron.fused_rope import FusedRoPE
    from megatron_mtraining.sparse import VerticalSlashConfig, build_vertical_slash_index
    from megatron_mtraining.sparse.kernels.block_bar.tables_kernel import launch_vertical_slash_tables
    from megatron_mtraining.sparse.kernels.index_build.top_p import take_top_p

    q, k = (torch.randn(1, 128, h, 16, generator=rng).to(kdevice) for h in (4, 2))
    config = VerticalSlashConfig(last_q=16, block_size=16)
    index = build_vertical_slash_index(q, k, config)
    top, order = torch.rand(4, 32, generator=rng).to(kdevice).sort(-1, descending=True)
    x = torch.randn(64, 1, 4, 16, generator=rng).to(kdevice).requires_grad_()
    freqs = torch.rand(64, 1, 1, 16, generator=rng).to(kdevice)
    with HostReads() as reads:
        launch_vertical_slash_tables(index)
        take_top_p(top, order, top.double().sum(-1, keepdim=True) * 0.9, 2, 2)
        FusedRoPE.apply(x, freqs, 1.0).sum().backward()
        build_vertical_slash_index(q, k, config)
    assert reads.count == 0
