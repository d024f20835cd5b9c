"""The capacity planner (``megatron_mtraining.planning``, ``python -m megatron_mtraining.plan``):
the cost model on hand-computed cases, every recorded measurement of the calibration tables
predicted within 10% (a change that breaks the model fails here), the stored works equal to a
fresh computation, and the command on a tiny config."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from megatron_mtraining.context_parallel import ContextParallelLayout, ring_sources, simulate_ring_areas
from megatron_mtraining.planning import calibration, model, validation, workload
from megatron_mtraining.planning.hardware import GPU, gpu, gpu_of_device, network_gb_s
from megatron_mtraining.planning.tables import table
from megatron_mtraining.sparse import DenseIndex, MSAConfig, VerticalSlashConfig, msa_select_blocks

H200 = gpu("H200")


@pytest.fixture(autouse=True)
def plan_cache(tmp_path, monkeypatch):
    """Indexes the planner builds go to a test's own cache."""
    monkeypatch.setenv("MTRAINING_PLAN_CACHE", str(tmp_path / "plan-cache"))


def test_every_recorded_measurement_within_ten_percent():
    """Each check of the tables (kernels, one-GPU training steps, 2-8 H200 attention) that is
    not stale or unmodeled is predicted within 10%; and there are enough of them to mean it."""
    checks = validation.all_checks()
    asserted = [ch for ch in checks if ch.asserted]
    misses = [f"{ch.table} | {ch.row} | {ch.quantity}: {ch.error:+.1%}" for ch in asserted if not ch.within]
    assert not misses, "\n".join(misses)
    by_table = {name: sum(ch.table == name for ch in asserted) for name in ("training_steps", "context_parallel")}
    assert by_table["training_steps"] >= 30 and by_table["context_parallel"] >= 30, by_table
    # Every excluded figure says why.
    assert all(ch.stale or ch.unmodeled or ch.role == "fit" for ch in checks if not ch.asserted)


def test_stored_works_equal_a_fresh_computation():
    """``workloads.json`` holds what the builders and the ring simulation give now (a small
    single-GPU row and a two-rank split, recomputed)."""
    for spec in (
        calibration.kernel_row_spec({"pattern": "natural", "seq": 32768}),
        calibration.kernel_row_spec({"pattern": "msa", "seq": 32768}),
        workload.WorkSpec("mtraining", 65536, 16, 2, 128, VerticalSlashConfig(block_size=128), "natural",
                          layout="zigzag", cp=2),
    ):  # fmt: skip
        stored = table("workloads")["works"][spec.key]
        fresh = workload.compute_work(spec).to_json()
        assert fresh == stored, spec.key


def test_topk_useful_pairs_by_hand_and_by_the_builder():
    # 10 tokens, blocks of 4, top 2: rows 0-3 attend 1..4; rows 4-7 their own 1..4 plus a whole
    # block; rows 8-9 1..2 plus a whole block: 10 + 26 + 11.
    assert workload.topk_useful_pairs(10, 4, 2, 1) == 47
    gen = torch.Generator().manual_seed(0)
    seq, heads, cfg = 256, 4, MSAConfig(block_size=16, topk=3, index_head_dim=8)
    index = msa_select_blocks(
        torch.randn(1, seq, 2, 8, generator=gen), torch.randn(1, seq, 1, 8, generator=gen), cfg, heads
    )
    assert float(index.attended_area().sum()) == workload.topk_useful_pairs(seq, 16, 3, heads)


def test_union_share_interpolates_in_log_length():
    points = {p["seq"]: p["share"] for p in table("kernels")["union_share"]["msa"]}
    assert workload.union_share("msa", "structured", 131072) == points[131072]
    between = workload.union_share("msa", "structured", 185364)  # 2^17.5
    assert between == pytest.approx(math.sqrt(points[131072] * points[262144]), rel=1e-3)
    assert workload.union_share("msa", "structured", 1 << 20) == points[262144]
    assert workload.union_share("msa", "structured", 1024) == points[32768]


def test_ring_sources_by_hand():
    """4 ranks: step s holds rank r - s's chunk (the flat and the hierarchical ring alike)."""
    assert torch.equal(ring_sources(4), torch.tensor([[0, 3, 2, 1], [1, 0, 3, 2], [2, 1, 0, 3], [3, 2, 1, 0]]))
    layout = ContextParallelLayout("striped", 4, 512, stripe=16)
    area = simulate_ring_areas(DenseIndex(1, 2, 512), layout, 16)
    # Rank r holds 8 stripes; at step s > 0 they attend 36 stripe pairs of rank r - s's
    # where r >= s, else 28; at step 0 their own: 28 pairs and 8 causal diagonal tiles
    # (2 heads of 16 x 16 tokens).
    pair, diagonal = 2 * 16 * 16, 2 * 16 * 17 // 2
    want = [[8 * diagonal + 28 * pair if s == 0 else (36 if r >= s else 28) * pair for s in range(4)] for r in range(4)]
    assert torch.equal(area, torch.tensor(want, dtype=torch.float64)), area


def _constants(**changes) -> model.Constants:
    per_pf = {name: (1000.0, 2500.0) for name in model.FAMILIES}
    return dataclasses.replace(model.Constants(kernel_ms_per_pf=per_pf, program_ms=(0.0, 0.0)), **changes)


def _gpu(**changes) -> GPU:
    return dataclasses.replace(H200, **{"attention_time_factor": 1.0, **changes})


def _run(**changes) -> model.Run:
    return dataclasses.replace(calibration.base_run(), gpu=_gpu(), **changes)


def _work(ring, columns, heads=1, seq=1024, pattern="mtraining") -> workload.AttentionWork:
    ring, columns = torch.tensor(ring, dtype=torch.float64), torch.tensor(columns, dtype=torch.float64)
    return workload.AttentionWork(pattern, "natural", seq, heads, 128, 128, ring, columns, ring.sum(1) + columns,
                                  float(ring.sum()), float(columns.sum()))  # fmt: skip


def test_kernel_time_by_hand():
    """1000 ms per forward PFLOP: 1e12 tile triples at head dim 128 are 0.512 PFLOP; bars the
    same; a launch's query blocks at 0.01 ms each."""
    c = _constants(program_ms=(0.01, 0.02))
    work = _work([[1e12]], [1e12], seq=131072)
    assert model.kernel_ms(c, work, "fwd", "block_bar", _gpu()) == pytest.approx(512 + 512 + 1024 * 0.01)
    assert model.kernel_ms(c, work, "bwd", "sdpa", _gpu()) == pytest.approx(2.5 * 1024)
    slower = _gpu(attention_time_factor=2.0, sdpa_kernel="sdpa_flash")
    assert model.kernel_ms(c, work, "fwd", "sdpa_flash", slower) == pytest.approx(2 * 1024)


def test_wide_blocks_on_one_gpu_take_the_varlen_calls():
    """MoBA's 4096-token chunks on one GPU run the varlen library calls, as ``sparse.dispatch``
    sends them (cuDNN's ragged attention on sm90, FlashAttention-2's on sm80, whose H200
    calibration is carried by the GPU's factor); narrower blocks stay on the plugin's kernels.
    The time is the useful area's: 1e12 triples at head dim 128, 0.512 PFLOP, 1000 ms each."""
    base = calibration.base_run()
    assert model.single_gpu_kernel(_run(), "moba") == "varlen"
    assert model.single_gpu_kernel(_run().replace(gpu=gpu("A100-80GB")), "moba") == "varlen_flash"
    narrow = dataclasses.replace(base.attention, moba=dataclasses.replace(base.attention.moba, chunk_size=512))
    assert model.single_gpu_kernel(_run(attention=narrow), "moba") in ("kv_outer", "block_bar")
    c = _constants()
    work = _work([[1e12]], [0.0], seq=131072, pattern="moba")
    assert model.kernel_ms(c, work, "fwd", "varlen", _gpu()) == pytest.approx(512)
    slower = _gpu(attention_time_factor=2.0, sdpa_kernel="sdpa_flash")
    assert model.kernel_ms(c, work, "bwd", "varlen_flash", slower) == pytest.approx(2 * 2.5 * 512)


def test_hierarchical_ring_hides_the_outer_transfer_behind_the_inner_ring():
    """CP 4 in 2 nodes of 2 (TP 1): the slowest rank's kernels, each step's time, and the
    outer transfer exposed only by what exceeds a whole inner ring."""
    c = _constants(ring_step_ms=(0.5, 0.0))
    att = dataclasses.replace(calibration.base_run().attention, hierarchy=2, layout="striped", stripe=128)
    run = _run(seq=262144, cp=4, attention=att, gpus_per_node=2, network="RoCE-100")
    pf = 1e12 / (4 * 128)  # triples of a forward TFLOP: 1 ms at 1000 ms per PFLOP
    work = _work([[pf, 2 * pf, pf, pf]] * 4, [0.0] * 4, seq=262144)
    call = model.attention_call(c, run, "mtraining", work)
    assert call.exchange == "hierarchical"
    assert call.kernels["fwd"] == pytest.approx(5 + 4 * 0.5)
    assert call.steps["fwd"] == pytest.approx([1.5, 2.5, 1.5, 1.5])
    # A 64K-token chunk of K and V (2 heads of 128, bf16) takes 5.97 ms over the network. The
    # forward's one outer transfer is posted before the index build and needed after the first
    # step (1.5 ms); the backward moves the accumulators (fp32) behind the first inner ring
    # (2.5 + 5.0 ms: a backward step is 2.5x its forward here).
    kv_bytes = 65536 * 2 * run.kv_heads * run.head_dim * 2
    outer = kv_bytes / (network_gb_s("RoCE-100") * 1e9) * 1e3
    assert outer > 4.0
    assert call.comm_exposed["fwd"]["network"] == pytest.approx(outer - 1.5)
    assert call.comm_exposed["fwd"]["nvlink"] == 0.0
    assert call.comm_total["bwd"]["network"] == pytest.approx(2 * outer)
    assert call.comm_exposed["bwd"]["network"] == pytest.approx(2 * outer - 7.5)
    assert (
        "fwd: the outer transfer (network, 5.97 ms a chunk's K/V) is NOT hidden (4.47 ms exposed at most) behind "
        "the index build and the first step, then the inner ring (2 steps, 3.00 ms)"
    ) in call.critical_path
    behind_index = model.attention_call(c, run, "mtraining", work, index_ms=5.0)
    assert behind_index.comm_exposed["fwd"]["network"] == 0.0


def test_gradient_exchange_and_optimizer_by_hand():
    """The distributed optimizer's reduce-scatter (bf16 gradients) and all-gather (bf16
    weights) over DP x CP = 8 ranks across 2 nodes of 4 at the network's rate."""
    run = _run(params=10**9, cp=4, dp=2, gpus_per_node=4, network="HDR-200", grad_bytes=2)
    seconds = model._gradient_exchange_s(run)["network"]
    assert seconds == pytest.approx(10**9 * 7 / 8 * 4 / (network_gb_s("HDR-200") * 1e9))


def test_step_adds_up_its_parts():
    """Micro-batches x layers x the layer, plus loss, embedding, optimizer, metrics and the
    gradient exchange; tokens/s and MFU follow from the step."""
    c = calibration.fit()
    run = _run(seq=131072, layers=4, global_batch=2, micro_batch=1, dp=1)
    step = model.predict_step(c, run, "mtraining")
    assert step.step_s == pytest.approx(sum(step.parts_s.values()))
    layers = 2 * 4 * step.layer.total / 1e3
    assert layers == pytest.approx(
        sum(v for k, v in step.parts_s.items() if k not in ("loss", "embedding", "optimizer", "metrics"))
    )
    assert step.tokens_per_s == pytest.approx(2 * 131072 / step.step_s)
    assert 0 < step.mfu < 1


def test_gpu_names_and_errors():
    assert gpu("H200").name == "H200-141GB" and gpu_of_device("NVIDIA H100 80GB HBM3").name == "H100-80GB"
    with pytest.raises(ValueError, match=r"gpu='B200'.*accepted: A100-40GB, A100-80GB, H100-80GB, H200-141GB"):
        gpu("B200")
    with pytest.raises(ValueError, match=r"network='IB'.*accepted: HDR-200"):
        network_gb_s("IB")
    with pytest.raises(ValueError, match=r"pattern source 'natural' is not one of msa's"):
        workload.WorkSpec("msa", 1024, 4, 2, 64, (128, 4), "natural")


def test_plan_command_on_a_tiny_config(capsys):
    """Every type side by side with its parts, memory and what it rests on; --search ranks
    layouts of 2 GPUs that fit and names the overrides of the best."""
    from megatron_mtraining import plan

    argv = ["--config", "configs/tiny_cpu.yaml", "megatron.micro_batch_size=1", "--nodes", "1", "--gpus-per-node", "2"]
    plan.main([*argv, "--search", "--top", "3"])
    out = capsys.readouterr().out
    for text in ("[plan] configs/tiny_cpu.yaml", "dense", "mtraining", "s/step", "seconds per step by part",
                 "attention per layer", "[plan] --search", "overrides of the best: megatron.tensor_model_parallel_size="):  # fmt: skip
        assert text in out, text


@pytest.mark.parametrize(
    "argv,message",
    [
        (
            ["--config", "configs/tiny_cpu.yaml", "megatron.pipeline_model_parallel_size=2"],
            "pipeline_model_parallel_size=2",
        ),
        (["--config", "configs/tiny_cpu.yaml", "cluster.network=IB"], "cluster.network': 'IB' (accepted: HDR-200"),
        (["--config", "no/such.yaml"], "--config='no/such.yaml': no such file"),
    ],
)
def test_plan_errors_name_the_field(argv, message, capsys):
    from megatron_mtraining import plan

    with pytest.raises(SystemExit) as err:
        plan.main(argv)
    assert message in str(err.value)


def test_dense_block_areas_without_documents_equal_the_mask():
    """The closed form the ring simulation of dense attention takes (a partial last block)."""
    index, block, seq = DenseIndex(2, 3, 1000), 64, 1000
    n = -(-seq // block)
    mask = index.to_dense_mask(seq).double().sum((0, 1))
    pooled = (
        torch.nn.functional.pad(mask, (0, n * block - seq, 0, n * block - seq)).view(n, block, n, block).sum((1, 3))
    )
    assert torch.equal(index.block_areas(block), pooled)
