"""The kernel dispatch: which implementation runs each kind of call, and the reason it gives.

CUDA calls are described by stand-ins for q (device, dtype, shape): the decision reads nothing
else, so every rule is checked on a CPU; the GPU tests run the kernels it picks.
"""

import logging
import types

import pytest
import torch

from megatron_mtraining.sparse import BlockTopKIndex, DenseIndex, VerticalSlashIndex, dispatch, sparse_attention
from megatron_mtraining.sparse.kernels import triton_available
from megatron_mtraining.sparse.kernels.dense_backends import flash_attn

pytestmark = pytest.mark.skipif(not triton_available(), reason="the kernel rules need Triton installed")


def cuda_q(seq=4096, heads=4, dim=64, dtype=torch.bfloat16):
    shape = torch.Size((1, seq, heads, dim))
    return types.SimpleNamespace(is_cuda=True, dtype=dtype, shape=shape, device=torch.device("cuda"), numel=shape.numel)


def topk(seq, k, block, heads=2):
    blocks = torch.full((1, seq, heads, k), -1, dtype=torch.int32)
    blocks[..., 0] = (torch.arange(seq) // block).view(1, seq, 1).int()
    return BlockTopKIndex(blocks=blocks, block_size=block, num_heads=4)


@pytest.fixture(autouse=True)
def auto_setting(monkeypatch):
    monkeypatch.delenv(dispatch.BACKEND_ENV, raising=False)
    monkeypatch.setattr(flash_attn, "interface", lambda: (None, "flash-attn is not installed"))


def test_whole_dense_attention_goes_to_the_fused_library_and_pieces_do_not():
    q, dense = cuda_q(), DenseIndex(1, 4, 4096)
    decision = dispatch.attention_kernel(q, dense)
    assert decision.kernel == "sdpa"
    assert "not flash-attn: flash-attn is not installed" in decision.reason
    piece = dispatch.attention_kernel(q, dense, piece=True)
    assert piece.kernel == "block_bar" and "running result" in piece.reason
    assert dispatch.attention_kernel(q, dense, piece=True, whole_blocks=True) == piece
    # A rank's tokens that are not whole tiles: every ring step on PyTorch, said so; forced
    # kernels fail.
    split = dispatch.attention_kernel(q, dense, piece=True, whole_blocks=False)
    assert split.kernel == "reference" and "not whole kernel tiles" in split.reason
    with pytest.raises(ValueError, match=r"backend='triton'.*a layout the kernels serve"):
        dispatch.attention_kernel(q, dense, "triton", piece=True, whole_blocks=False)
    assert dispatch.attention_kernel(q, dense, "triton").kernel == "block_bar"
    assert dispatch.attention_kernel(q, dense, "sdpa") == dispatch.Decision("sdpa", "forced")
    # fp32 is outside the fused libraries' dtypes: the plugin's kernels take it.
    assert dispatch.attention_kernel(cuda_q(dtype=torch.float32), dense).kernel == "block_bar"


def _deterministic_decision(q, index):
    """``attention_kernel`` under torch's deterministic mode, the mode restored after."""
    previous = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        return dispatch.attention_kernel(q, index)
    finally:
        torch.use_deterministic_algorithms(previous)


def test_deterministic_mode_keeps_dense_attention_off_cudnn():
    q, dense = cuda_q(), DenseIndex(1, 4, 4096)
    decision = _deterministic_decision(q, dense)
    assert decision.kernel == "block_bar" and "deterministic mode" in decision.reason
    assert dispatch.attention_kernel(q, dense).kernel == "sdpa"


def test_top_k_indices_pick_their_loop_order_by_the_share_they_select():
    q = cuda_q(seq=4096)
    narrow = dispatch.attention_kernel(q, topk(4096, 8, 16))  # 128 of 4096 keys: 1/32
    assert narrow.kernel == "kv_outer" and "0.0312 of the keys in blocks of 16" in narrow.reason
    wide = dispatch.attention_kernel(q, topk(4096, 32, 16))  # 1/8
    assert wide.kernel == "block_bar" and "0.1250" in wide.reason
    assert dispatch.attention_kernel(q, topk(4096, 8, 16), piece=True).kernel == "block_bar"
    vs = VerticalSlashIndex(
        torch.zeros(1, 4, 1, dtype=torch.int32), torch.zeros(1, 4, 1, dtype=torch.int32), seq_len=4096, block_size=64
    )
    assert dispatch.attention_kernel(q, vs).kernel == "block_bar"


def test_wide_top_k_blocks_go_a_key_block_at_a_time_to_the_varlen_library(monkeypatch):
    """MoBA's chunks (blocks of at least ``VARLEN_MIN_BLOCK`` tokens) run on ``varlen_blocks``
    where the library serves the call; narrower blocks, pieces, a forced ``triton``, torch's
    deterministic mode and packed documents keep the plugin's kernels, and a wide-block decision
    says why it is not the library's. Forcing ``varlen_blocks`` where it cannot run fails."""
    from megatron_mtraining.sparse.documents import packed_documents
    from megatron_mtraining.sparse.kernels.varlen_blocks import choose, cudnn_library, library

    monkeypatch.delenv(choose.LIBRARY_ENV, raising=False)
    monkeypatch.setattr(library, "unsupported", lambda q: None)  # stands for a GPU it serves
    monkeypatch.setattr(cudnn_library, "unsupported", lambda q: None)  # an sm90 with cudnn-frontend
    q, seq = cuda_q(seq=65536), 65536
    moba = topk(seq, 4, 4096)  # a quarter of the keys: the union of tiles otherwise
    decision = dispatch.attention_kernel(q, moba)
    assert decision.kernel == "varlen_blocks" and "4096-token blocks" in decision.reason
    # The reason names the library: cuDNN's where it serves the call, else FlashAttention-2's.
    assert "on cuDNN's ragged attention (cudnn-frontend, MTRAINING_VARLEN_LIBRARY=auto)" in decision.reason
    monkeypatch.setattr(cudnn_library, "unsupported", lambda q: "got a GPU of compute capability (8, 0)")
    assert "on PyTorch's FlashAttention-2 varlen kernels (not cuDNN's" in dispatch.attention_kernel(q, moba).reason
    monkeypatch.setattr(cudnn_library, "unsupported", lambda q: None)
    monkeypatch.setenv(choose.LIBRARY_ENV, "flash")
    assert "on PyTorch's FlashAttention-2 varlen kernels (MTRAINING_VARLEN_LIBRARY=flash)" in (
        dispatch.attention_kernel(q, moba).reason
    )
    monkeypatch.delenv(choose.LIBRARY_ENV)
    assert dispatch.attention_kernel(q, moba, "varlen_blocks") == dispatch.Decision("varlen_blocks", "forced")
    narrow = dispatch.attention_kernel(q, topk(seq, 4, dispatch.VARLEN_MIN_BLOCK // 2))
    assert narrow.kernel == "kv_outer" and "varlen" not in narrow.reason
    assert dispatch.attention_kernel(q, moba, piece=True).kernel == "block_bar"
    triton = dispatch.attention_kernel(q, moba, "triton")
    assert triton.kernel == "block_bar" and "varlen" not in triton.reason
    deterministic = _deterministic_decision(q, moba)
    assert deterministic.kernel == "block_bar" and "(not varlen_blocks: deterministic mode" in deterministic.reason
    documents = packed_documents(torch.tensor([0, 30000, seq], dtype=torch.int32), seq)
    packed = dispatch.attention_kernel(q, BlockTopKIndex(moba.blocks, 4096, 4, documents=documents))
    assert packed.kernel == "block_bar" and "not varlen_blocks: got packed documents" in packed.reason
    with pytest.raises(ValueError, match=r"backend='varlen_blocks'.*got a DenseIndex"):
        dispatch.attention_kernel(q, DenseIndex(1, 4, seq), "varlen_blocks")
    cpu = torch.zeros(1, seq, 4, 64, dtype=torch.bfloat16)
    assert dispatch.varlen_blocks_preferred(cpu, moba) == (False, "cpu tensors")
    monkeypatch.setattr(library, "unsupported", lambda q: "got head dim 12")
    assert "(not varlen_blocks: got head dim 12)" in dispatch.attention_kernel(q, moba).reason
    with pytest.raises(ValueError, match=r"backend='varlen_blocks'.*got head dim 12"):
        dispatch.attention_kernel(q, moba, "varlen_blocks")


def test_the_varlen_library_says_what_it_does_not_serve():
    from megatron_mtraining.sparse.kernels.varlen_blocks import library

    assert library.unsupported(torch.zeros(4, 2, 64, dtype=torch.bfloat16)) == "got inputs on cpu"
    assert library.unsupported(cuda_q(dtype=torch.float32)) == "got torch.float32"
    assert library.unsupported(cuda_q(dim=12)) == "got head dim 12"
    assert library.unsupported(cuda_q(dim=264)) == "got head dim 264"


def test_the_reference_path_says_why():
    cpu = torch.zeros(1, 64, 4, 16)
    assert dispatch.attention_kernel(cpu, DenseIndex(1, 4, 64)) == dispatch.Decision("reference", "cpu tensors")
    assert dispatch.attention_kernel(cuda_q(), DenseIndex(1, 4, 4096), "reference").reason == "forced"
    wide_head = dispatch.attention_kernel(cuda_q(dim=512), topk(4096, 8, 16))
    assert wide_head.kernel == "reference" and "head dim 512" in wide_head.reason
    with pytest.raises(ValueError, match=r"backend='triton'.*head dim <= 256"):
        dispatch.attention_kernel(cuda_q(dim=512), topk(4096, 8, 16), "triton")
    with pytest.raises(ValueError, match=r"backend='sdpa'.*got a BlockTopKIndex"):
        dispatch.attention_kernel(cuda_q(), topk(4096, 8, 16), "sdpa")


def test_a_call_logs_its_decision_at_debug(caplog, rng):
    q = torch.randn(1, 32, 2, 8, generator=rng)
    with caplog.at_level(logging.DEBUG, logger="megatron_mtraining.dispatch"):
        sparse_attention(q, q[:, :, :1], q[:, :, :1], DenseIndex(1, 2, 32))
    assert [r.getMessage() for r in caplog.records] == ["sparse_attention -> reference: cpu tensors"]


def test_the_kl_under_context_parallelism_needs_whole_kernel_blocks():
    """``kl_kernel`` with ``whole_blocks`` (the ring's steps): the kernels where the layout's
    tokens are whole kernel blocks (``StepTables.whole_blocks``), else PyTorch; forcing the
    kernels then fails. Packed documents too: the kernels mask each row by its document
    start."""
    from megatron_mtraining.context_parallel import ContextParallelLayout
    from megatron_mtraining.context_parallel.step_tables import StepTables
    from megatron_mtraining.sparse.documents import packed_documents

    q, q_idx = cuda_q(seq=256), cuda_q(seq=256, heads=2, dim=32)
    index = topk(256, 2, 16)
    assert dispatch.kl_kernel(q, q_idx, index, whole_blocks=True).kernel == "msa_kl"
    split = dispatch.kl_kernel(q, q_idx, index, whole_blocks=False)
    assert split.kernel == "reference" and "not whole kernel blocks" in split.reason
    with pytest.raises(ValueError, match=r"backend='triton'.*layout the KL kernels serve"):
        dispatch.kl_kernel(q, q_idx, index, "triton", whole_blocks=False)
    docs = DenseIndex(1, 4, 256, documents=packed_documents(torch.tensor([0, 100, 256], dtype=torch.int32), 256))
    documented = dispatch.kl_kernel(q, q_idx, docs, whole_blocks=True)
    assert documented.kernel == "msa_kl" and "document start" in documented.reason, documented
    assert dispatch.kl_kernel(q, q_idx, docs, whole_blocks=False).kernel == "reference"
    assert dispatch.kl_kernel(cuda_q(seq=256, dtype=torch.float64), q_idx, index, whole_blocks=True).kernel == (
        "reference"
    )

    def whole(index, kind, stripe):
        layout = ContextParallelLayout(kind, 2, 256, stripe=stripe)
        return StepTables(index, layout.token_positions(1, "cpu")).whole_blocks()

    assert whole(index, "striped", 16) and whole(index, "zigzag", 16) and whole(index, "contiguous", 16)
    assert not whole(index, "striped", 8)  # stripes of 8 tokens, blocks of 16
    dense = DenseIndex(1, 4, 256)
    assert whole(dense, "striped", 16) and not whole(dense, "striped", 8)  # the smallest dense tile is 16
