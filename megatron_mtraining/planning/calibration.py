"""The cost model's constants, fitted to the measured tables (``calibration/*.json``).

Which rows fit what:

* kernel times per FLOP (``model.FAMILIES``) and the per-query-block cost of a block_bar
  launch: a least-squares fit (relative errors) to every single-GPU kernel row of
  ``kernels.json``, forward and backward apart;
* the ring's cost of keys at other ranks' positions and per ring step, and the
  all-gather's per call: the rows of ``context_parallel.json`` whose role is ``fit`` (two
  GPUs, the latest code), each predicted from its run's own single-GPU kernel time;
* the layers' non-attention time over their matmul floor: the non-attention part of the
  128K H200 ``mtraining`` layer under the three recomputation policies (profile parts);
* the vertical-slash index build in a step, the metric steps, the output layer and loss,
  the optimizer and embedding, MSA's selection and KL (KV-outer from the step's parts, union
  of tiles and warmup from ``kernels.json`` / the warmup step): one figure each;
* 64 x 64 tiles: the 128K H100 ``mtraining`` row with block 64 (full recompute).

Everything else in the tables is a check (``validation.py``).
"""

from __future__ import annotations

import dataclasses
import functools

import torch

from ..sparse import VerticalSlashConfig
from . import model
from .flops import attention_flops
from .hardware import gpu, gpu_of_device
from .model import DIRECTIONS, FAMILIES, PF, Constants
from .tables import source, table
from .workload import AttentionWork, WorkSpec, attention_work, topk_useful_pairs

HEADS, KV_HEADS, HEAD_DIM = 16, 2, 128  # Qwen2.5-3B attention, every table's shape
TOPK_SETTINGS = {"msa": (128, 16), "moba": (4096, 12)}


def kernel_row_spec(row: dict) -> WorkSpec:
    """The work a ``kernels.json`` row measured (one GPU)."""
    pattern, _, variant = row["pattern"].partition("-")
    if pattern in ("natural", "diffuse"):
        return WorkSpec(
            "mtraining", row["seq"], HEADS, KV_HEADS, HEAD_DIM, VerticalSlashConfig(block_size=128), pattern
        )
    if pattern == "dense":
        return WorkSpec("dense", row["seq"], HEADS, KV_HEADS, HEAD_DIM)
    return WorkSpec(pattern, row["seq"], HEADS, KV_HEADS, HEAD_DIM, TOPK_SETTINGS[pattern], variant or "structured")


def measured_kernel_ms(row: dict, work: AttentionWork) -> tuple[float, float]:
    """(fwd, bwd) ms of a row, from its times or from its useful TFLOP/s."""
    if "fwd_ms" in row:
        return row["fwd_ms"], row["bwd_ms"]
    flops = attention_flops(float(work.useful.sum()), work.head_dim)
    return flops / (row["fwd_tflops"] * 1e12) * 1e3, 2.5 * flops / (row["bwd_tflops"] * 1e12) * 1e3


def _kernel_features(row: dict, work: AttentionWork) -> dict[str, float]:
    """Forward PFLOPs per family (and query blocks, ``program``) of a single-GPU row."""
    d, kernel = work.head_dim, row["kernel"]
    if kernel in model.LIBRARY_KERNELS:
        return {kernel: attention_flops(float(work.useful.sum()), d) / PF}
    if kernel == "kv_outer":
        return {model.kv_outer_family(work): attention_flops(float(work.useful.sum()), d) / PF}
    family = "tile" if work.pattern in ("dense", "mtraining") else f"{work.pattern}_union"
    return {
        family: attention_flops(work.single_tiles, d) / PF,
        "bar": attention_flops(work.single_bars, d) / PF,
        "program": work.seq / work.block,
    }


def nonnegative_lstsq(a: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Least squares with every coefficient >= 0 (a cost is never negative): columns whose
    coefficient comes out negative are dropped (set to 0) and the rest refitted."""
    keep = torch.ones(a.shape[1], dtype=torch.bool)
    while True:
        x = torch.zeros(a.shape[1], dtype=torch.float64)
        x[keep] = torch.linalg.lstsq(a[:, keep], y.view(-1, 1)).solution.flatten()
        if (x >= 0).all():
            return x
        keep &= x > 0


def _fit_kernels() -> tuple[dict, tuple[float, float]]:
    columns = (*FAMILIES, "program")
    rows = table("kernels")["rows"]
    features, measured = [], []
    for row in rows:
        work = attention_work(kernel_row_spec(row))
        f = _kernel_features(row, work)
        features.append([f.get(name, 0.0) for name in columns])
        measured.append(measured_kernel_ms(row, work))
    a = torch.tensor(features, dtype=torch.float64)
    fitted = {}
    for i, direction in enumerate(DIRECTIONS):
        y = torch.tensor([m[i] for m in measured], dtype=torch.float64)
        # Relative errors: each row weighs by its own time.
        x = nonnegative_lstsq(a / y.view(-1, 1), torch.ones_like(y))
        fitted[direction] = dict(zip(columns, x.tolist(), strict=True))
    per_pf = {name: (fitted["fwd"][name], fitted["bwd"][name]) for name in FAMILIES}
    return per_pf, (fitted["fwd"]["program"], fitted["bwd"]["program"])


def cp_row_run(row: dict, base: model.Run) -> model.Run:
    """The run of a ``context_parallel.json`` row (one host: every GPU on NVLink)."""
    attention = dataclasses.replace(
        base.attention,
        type="dense" if row["pattern"] == "dense" else "mtraining",
        layout=row["layout"],
        stripe=128,
        hierarchy=row.get("inner"),
        kv_exchange=row["exchange"],
    )
    return base.replace(
        seq=row["tokens"], cp=row["gpus"], tp=1, dp=1, micro_batch=1, attention=attention, gpus_per_node=row["gpus"],
        gpu=gpu_of_device(source("context_parallel", row["source"])["device"]), sources=("natural",),
    )  # fmt: skip


def cp_row_work(row: dict) -> tuple[AttentionWork, AttentionWork]:
    """(the rank split of a CP row's work, the same work on one GPU)."""
    pattern = "dense" if row["pattern"] == "dense" else "mtraining"
    settings = None if pattern == "dense" else VerticalSlashConfig(block_size=128)
    sources = {"source": "natural"} if pattern == "mtraining" else {}
    split = WorkSpec(
        pattern, row["tokens"], HEADS, KV_HEADS, HEAD_DIM, settings, layout=row["layout"], stripe=128,
        cp=row["gpus"], **sources,
    )  # fmt: skip
    whole = WorkSpec(pattern, row["tokens"], HEADS, KV_HEADS, HEAD_DIM, settings, **sources)
    return attention_work(split), attention_work(whole)


def kernel_scales(c: Constants, row: dict, whole: AttentionWork) -> tuple[float, float]:
    """The run's own single-GPU kernel time over the model's (1 where the row has none): the
    kernels' speed at the row's commit."""
    if "single_tflops" not in row:
        return 1.0, 1.0
    flops = attention_flops(float(whole.useful.sum()), whole.head_dim)
    measured = (flops / (row["single_tflops"][0] * 1e12) * 1e3, 2.5 * flops / (row["single_tflops"][1] * 1e12) * 1e3)
    device = gpu_of_device(source("context_parallel", row["source"])["device"])
    return tuple(
        m / model.kernel_ms(c, whole, d, "block_bar", device) for m, d in zip(measured, DIRECTIONS, strict=True)
    )


def predict_cp_row(c: Constants, row: dict, base: model.Run) -> dict[str, float]:
    """Predicted fwd / bwd ms of a CP row (kernels scaled to its run's single GPU), and the
    single-GPU time."""
    work, whole = cp_row_work(row)
    run = cp_row_run(row, base)
    scales = kernel_scales(c, row, whole)
    scaled = dataclasses.replace(
        c, kernel_ms_per_pf={k: tuple(v * s for v, s in zip(vs, scales, strict=True)) for k, vs in c.kernel_ms_per_pf.items()},
        program_ms=tuple(v * s for v, s in zip(c.program_ms, scales, strict=True)),
    )  # fmt: skip
    call = model.attention_call(scaled, run, run.attention.type, work)
    out = {f"{d}_ms": call.total(d) for d in DIRECTIONS}
    for d in DIRECTIONS:
        out[f"single_{d}_ms"] = model.kernel_ms(scaled, whole, d, "block_bar", run.gpu)
    return out


def _fit_ring(c: Constants, base: model.Run) -> Constants:
    """The ring's position cost and step cost and the all-gather's call cost, per direction,
    from the rows whose role is ``fit``: each row's time less what the model predicts without
    these terms, linear in them."""
    rows = [r for r in table("context_parallel")["rows"] if r.get("role") == "fit"]
    zero = dataclasses.replace(c, ring_positions=(0.0, 0.0), ring_step_ms=(0.0, 0.0), allgather_ms=(0.0, 0.0))
    fitted = {}
    for direction in DIRECTIONS:
        a, y = [], []
        for row in rows:
            base_ms = predict_cp_row(zero, row, base)[f"{direction}_ms"]
            if row["exchange"] == "ring":
                # The kernels' own share (what the position cost multiplies): the prediction
                # less its exposed transfers, which are ~0 on one host.
                a.append([base_ms, row["gpus"], 0.0])
            else:
                a.append([0.0, 0.0, 1.0])
            y.append(row[f"{direction}_ms"] - base_ms)
        x = nonnegative_lstsq(torch.tensor(a, dtype=torch.float64), torch.tensor(y, dtype=torch.float64))
        fitted[direction] = x.tolist()
    return dataclasses.replace(
        c,
        ring_positions=(fitted["fwd"][0], fitted["bwd"][0]),
        ring_step_ms=(fitted["fwd"][1], fitted["bwd"][1]),
        allgather_ms=(fitted["fwd"][2], fitted["bwd"][2]),
    )


def _step_rows() -> dict[str, dict]:
    return {row["id"]: row for row in table("training_steps")["rows"]}


def _fit_layers(c: Constants, base: model.Run) -> Constants:
    """The layers' non-attention time over their matmuls at the GPU's rate, from the
    non-attention parts of the 128K H200 ``mtraining`` layer under the three recomputation
    policies (norms, RoPE, SwiGLU and residual adds run once per matmul pass, so one factor
    carries them); the index build and metric steps from the same runs."""
    rows = _step_rows()
    h200 = gpu("H200")
    a, y = [], []
    for name, policy in (("", "full"), ("-none", "none"), ("-mlp", "mlp")):
        row = rows[f"h200-128k-mtraining{name}"]
        run = base.replace(seq=row["seq"], recompute=policy, gpu=h200)
        layer = model.predict_layer(dataclasses.replace(c, matmul_efficiency=1.0), run, "mtraining")
        a.append([layer.parts["matmuls"]])
        y.append(row["parts_ms_per_layer"]["non_attention"])
    efficiency = float(nonnegative_lstsq(torch.tensor(a, dtype=torch.float64), torch.tensor(y, dtype=torch.float64)))
    full = rows["h200-128k-mtraining"]
    index = full["parts_ms_per_layer"]["index_per_pass"] / full["seq"] * 1e6
    # The metric steps: a step with them less one without, per layer.
    with_metrics, without = rows["h200-128k-mtraining"], rows["h200-128k-mtraining-nometrics"]
    per_layer = (with_metrics["s_per_iter"] - without["s_per_iter"]) * 1e3 / with_metrics["layers"]
    msa = rows["h200-128k-msa"]
    metrics = {
        "mtraining": per_layer / with_metrics["seq"] * 1e6,
        "moba": per_layer / with_metrics["seq"] * 1e6,
        "msa": msa["parts_ms_per_layer"]["metrics"] / msa["seq"] * 1e6,
    }
    return dataclasses.replace(
        c,
        matmul_efficiency=efficiency,
        index_ms_per_mtoken=index,
        index_key_share=table("kernels")["index_build"]["key_pass_share"]["value"],
        metrics_ms_per_mtoken=metrics,
    )


def _fit_fixed(c: Constants, base: model.Run) -> Constants:
    """Output layer and loss, optimizer and embedding from the 128K H200 step's parts."""
    parts = table("training_steps")["fixed_part_parts"]
    h200, seq = gpu("H200"), parts["seq"]
    out_flops = 2 * base.hidden * base.vocab * seq
    gemm_floor = 3 * out_flops / (h200.matmul_tflops * 1e12) * 1e3
    passes_floor = 3 * seq * base.vocab * 2 / (h200.hbm_tb_s * 1e12) * 1e3
    return dataclasses.replace(
        c,
        output_efficiency=(parts["loss_ms"] - parts["logits_passes_ms"]) / gemm_floor,
        logits_pass_factor=parts["logits_passes_ms"] / passes_floor,
        optimizer_ms_per_gparam_tbs=(parts["optimizer_ms"] + parts["grads_ms"])
        * h200.hbm_tb_s
        / (parts["optimizer_parameters"] / 1e9),
        embedding_ms_per_mtoken=parts["embedding_ms"] / seq * 1e6,
    )


def _fit_msa(c: Constants) -> Constants:
    """MSA's selection and KV-outer KL from the 128K step's parts, the union-of-tiles KL from
    ``kernels.json``, the warmup KL from the warmup step's parts."""
    rows = _step_rows()
    parts = rows["h200-128k-msa-b"]["parts_ms_per_layer"]
    seq = rows["h200-128k-msa-b"]["seq"]
    scored = seq * seq * KV_HEADS * 128 / PF
    block, topk = TOPK_SETTINGS["msa"]
    useful = attention_flops(topk_useful_pairs(seq, block, topk, HEADS), HEAD_DIM) / PF
    kl = table("kernels")["msa_kl"]
    union = attention_flops(kl["union_share_of_causal"] * HEADS * kl["seq"] * (kl["seq"] + 1) / 2, HEAD_DIM) / PF
    warmup = rows["h200-128k-msa-warmup-b"]
    causal = attention_flops(HEADS * seq * (seq + 1) / 2, HEAD_DIM) / PF
    return dataclasses.replace(
        c,
        msa_selection_ms_per_pf=parts["msa_selection"] / scored,
        msa_kl_ms_per_pf=parts["msa_kl"] / useful,
        msa_kl_union_ms_per_pf=kl["union_ms"] / union,
        msa_warmup_kl_ms_per_pf=warmup["parts_ms_per_layer"]["msa_kl"] / causal,
    )


def _fit_block64(c: Constants, base: model.Run) -> Constants:
    """The block_bar time factor of 64 x 64 tiles: the one that makes the 128K H100 row with
    block 64 (full recompute, profile parts) come out at its measured per-layer time."""
    row = _step_rows()["h100-128k-mtraining-b64"]
    run = validation_run(base, row)
    layer = model.predict_layer(c, run, "mtraining")
    attention = layer.parts["attention_fwd"] + layer.parts["attention_bwd"]
    rest = layer.total - attention
    return dataclasses.replace(c, block64_factor=(row["per_layer_ms"] - rest) / attention)


def validation_run(base: model.Run, row: dict) -> model.Run:
    """The run of a ``training_steps.json`` row: the base shape at its length, layers,
    recomputation, attention type and tiles, on its GPU, one sample per step."""
    pattern = {"cudnn": "dense", "dense-triton": "dense", "msa-warmup": "msa"}.get(row["row"], row["row"])
    backend = {"cudnn": "sdpa", "dense-triton": "triton"}.get(row["row"], "auto")
    mtraining = dataclasses.replace(base.attention.mtraining, block_size=row.get("block", 128))
    attention = dataclasses.replace(base.attention, type=pattern, mtraining=mtraining, hierarchy=None)
    return base.replace(
        seq=row["seq"], layers=row["layers"], recompute=row["recompute"], recomputed_layers=None,
        log_interval=row.get("log_interval", 1), attention=attention, backend=backend,
        sources=("diffuse", "untrained"),
        gpu=gpu_of_device(source("training_steps", row["source"])["device"]), params=base_params(base, row["layers"]),
    )  # fmt: skip


def base_params(base: model.Run, layers: int) -> int:
    """Parameters of the base shape with ``layers`` layers (tied embeddings, one rank)."""
    per_layer = (base.params - base.vocab * base.hidden - base.hidden) / base.layers
    return int(base.vocab * base.hidden + base.hidden + layers * per_layer)


@functools.cache
def base_run() -> model.Run:
    """The tables' model: ``configs/qwen2.5-3b/base.yaml`` (Qwen2.5-3B) on one GPU, as
    ``scripts/bench_training.py`` runs it."""
    from ..configs import packaged
    from ..training.yaml_config import load_config
    from .runs import resolve_quietly, run_from_args

    config = load_config(packaged("qwen2.5-3b/base.yaml"), ["megatron.global_batch_size=1", "megatron.log_interval=1"])
    args = resolve_quietly(config, world_size=1)
    return run_from_args(args, config, gpu_name="H200-141GB")


@functools.cache
def fit() -> Constants:
    """Every constant, fitted in dependency order (kernels first: the rest predicts with them)."""
    base = base_run()
    per_pf, program = _fit_kernels()
    c = Constants(kernel_ms_per_pf=per_pf, program_ms=program)
    c = _fit_ring(c, base)
    c = _fit_layers(c, base)
    c = _fit_fixed(c, base)
    c = _fit_msa(c)
    return _fit_block64(c, base)
