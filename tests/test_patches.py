"""The Megatron patches: version guard and fingerprints (torch's release range for the CPU
stand-ins), install/remove at every import site, batch split and RoPE rows per CP rank for
every layout (zigzag equal to Megatron's own), and the inner/outer groups of the hierarchical
ring, on spawned gloo processes.

Workers are forked rather than spawned: each spawned process would import megatron.core
again (seconds each on two cores).
"""

import ast
import dataclasses
import importlib
import io
import logging
import os
from pathlib import Path

import megatron.core.utils as megatron_utils
import pytest
import torch
import torch.distributed as dist
from gloo import run
from megatron.core import package_info, parallel_state
from megatron.core.models.common.embeddings import rope_utils
from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding
from torch.overrides import TorchFunctionMode

import megatron_mtraining.patches as patches_package
from megatron_mtraining.context_parallel import ContextParallelLayout
from megatron_mtraining.context_parallel.layout import KINDS
from megatron_mtraining.context_parallel.ring import _rings
from megatron_mtraining.megatron.cp_groups import hierarchy_from_megatron, inner_size_from_nodes, new_hierarchy
from megatron_mtraining.patches import (
    PATCHES,
    SUPPORTED_VERSION,
    TORCH_VERSIONS,
    UpstreamChangedError,
    applied_layout,
    apply_cpu_patches,
    apply_patches,
    atomic_tracker,
    cp_batch_split,
    cp_rope_slice,
    cpu_compat,
    dataset_helpers,
    remove_patches,
)
from megatron_mtraining.patches._guard import fingerprint

ORIGINAL_SPLIT = megatron_utils.get_batch_on_this_cp_rank
ORIGINAL_ROPE = rope_utils.get_pos_emb_on_this_cp_rank
# Every patch the package can install; the CPU ones are installed by the spawned workers of
# the Megatron tests, never in this process.
REGISTERED = (
    *PATCHES,
    *cpu_compat.PATCHES,
    *cpu_compat.TRAINING_PATCHES,
    dataset_helpers.PATCH,
    atomic_tracker.PATCH,
)


@pytest.fixture(autouse=True)
def _unpatched():
    remove_patches()
    yield
    remove_patches()


def test_recorded_fingerprints_match_installed_megatron():
    """Fails when upstream changes a function a patch replaces or reproduces: review it, adapt
    the patch, record the new fingerprint. A patch of torch has none: its check is torch's
    release."""
    for patch in REGISTERED:
        module = importlib.import_module(patch.module)
        assert bool(patch.fingerprints) != patch.patches_torch, patch.target
        # A CPU stand-in installed in this process by an earlier test (the checkpoint
        # conversion applies them in process) holds the upstream function it replaced.
        installed = patch.replacement is not None
        for name, recorded in patch.fingerprints.items():
            fn = getattr(module, name)
            fn = patch.original if installed and fn is patch.replacement else fn
            assert fingerprint(fn) == recorded, f"{patch.module}.{name} changed upstream"
        for where, recorded in patch.callers.items():
            module_name, _, name = where.rpartition(".")
            assert fingerprint(getattr(importlib.import_module(module_name), name)) == recorded, where
        if not installed:
            patch.check()


def _megatron_importers(name: str, from_module: str | None = None) -> set[str]:
    """Files of the installed megatron package with an ``import`` of ``name`` (from
    ``from_module`` when given)."""
    root = Path(megatron_utils.__file__).parents[2]
    found = set()
    for path in (root / "megatron").rglob("*.py"):
        text = path.read_text(encoding="utf-8")
        if name not in text:
            continue
        for node in ast.walk(ast.parse(text)):
            if (
                isinstance(node, ast.ImportFrom)
                and from_module in (None, node.module)
                and any(alias.name == name for alias in node.names)
            ):
                found.add(path.relative_to(root).as_posix())
    return found


def test_import_sites_are_recorded():
    """A new upstream import site of a patched function fails here, so it gets reviewed."""
    for patch in REGISTERED:
        # torch's names (Stream, synchronize, ...) are common; only imports from torch count.
        from_module = patch.module if patch.patches_torch else None
        assert _megatron_importers(patch.name, from_module) == set(patch.import_sites), patch.target


def test_apply_swaps_every_import_site_and_remove_restores():
    for patch in PATCHES:
        for site in patch.import_sites:
            importlib.import_module(site.removesuffix(".py").replace("/", "."))
    choice = apply_patches("striped", 16)
    assert applied_layout() == choice and (choice.kind, choice.stripe) == ("striped", 16)
    for patch in PATCHES:
        assert getattr(importlib.import_module(patch.module), patch.name) is patch.replacement
        for site in patch.import_sites:
            held = vars(importlib.import_module(site.removesuffix(".py").replace("/", "."))).get(patch.name)
            assert held in (None, patch.replacement), site  # None: imported inside a function, at call time
    assert apply_patches("striped", 16) == choice  # idempotent
    with pytest.raises(ValueError, match=r"layout_kind='striped' \(now 'zigzag'\), stripe=16 \(now 128\)"):
        apply_patches("zigzag")
    remove_patches()
    assert applied_layout() is None
    assert megatron_utils.get_batch_on_this_cp_rank is ORIGINAL_SPLIT
    assert rope_utils.get_pos_emb_on_this_cp_rank is ORIGINAL_ROPE
    from megatron.core.models.common.embeddings import rotary_pos_embedding
    from megatron.training import training

    assert training.get_batch_on_this_cp_rank is ORIGINAL_SPLIT
    assert rotary_pos_embedding.get_pos_emb_on_this_cp_rank is ORIGINAL_ROPE


@pytest.mark.parametrize(
    "kind,stripe,match", [("ring", 128, "layout_kind='ring'"), ("striped", 0, "stripe=0"), ("striped", 2.0, "stripe")]
)
def test_bad_arguments_name_the_field(kind, stripe, match):
    with pytest.raises(ValueError, match=match):
        apply_patches(kind, stripe)
    assert applied_layout() is None


def test_other_version_with_unchanged_functions_applies(monkeypatch, caplog):
    monkeypatch.setattr(package_info, "__version__", "0.20.0")
    with caplog.at_level(logging.WARNING):
        apply_patches("striped", 8)
    assert megatron_utils.get_batch_on_this_cp_rank is cp_batch_split.PATCH.replacement
    assert "0.20.0" in caplog.text and SUPPORTED_VERSION in caplog.text


def test_other_version_with_changed_function_refuses(monkeypatch):
    """A changed fingerprint fails loudly, names both versions, and changes nothing."""
    monkeypatch.setattr(package_info, "__version__", "0.20.0+abc123")
    monkeypatch.setitem(cp_rope_slice.PATCH.fingerprints, "get_pos_emb_on_this_cp_rank", "0" * 16)
    with pytest.raises(UpstreamChangedError, match=r"installed megatron-core 0\.20\.0, supported 0\.19\.2") as err:
        apply_patches("striped", 8)
    assert "rope_utils.get_pos_emb_on_this_cp_rank" in str(err.value) and "upstream changed it" in str(err.value)
    assert applied_layout() is None
    assert megatron_utils.get_batch_on_this_cp_rank is ORIGINAL_SPLIT  # checked before anything was installed


@pytest.mark.parametrize("name", ["get_batch_on_this_cp_rank", "_get_batch_on_this_cp_rank_per_sequence_balancing"])
def test_changed_function_on_supported_version_refuses(monkeypatch, name):
    """Also the reproduced helper: the replacement copies its choice of keys."""

    def edited(batch, *args, **kwargs):
        return batch

    monkeypatch.setattr(megatron_utils, name, edited)
    with pytest.raises(UpstreamChangedError, match=rf"megatron\.core\.utils\.{name} is not the function.*modified in"):
        apply_patches("zigzag")
    assert applied_layout() is None


def test_missing_upstream_function_refuses(monkeypatch):
    monkeypatch.delattr(rope_utils, "_apply_rotary_pos_emb_thd")
    with pytest.raises(UpstreamChangedError, match="_apply_rotary_pos_emb_thd does not exist"):
        apply_patches("striped", 8)


@pytest.fixture
def without_cuda(monkeypatch):
    """A machine without CUDA as apply_cpu_patches sees it; the tests below make it refuse, so
    nothing reaches this process (the workers that install the stand-ins are spawned)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    # As in a fresh process, even where an earlier test applied them here (the checkpoint
    # conversion does): every check runs again, and the refusals below come before any install.
    monkeypatch.setattr(patches_package, "_cpu_applied", False)
    monkeypatch.setattr(patches_package, "_cpu_training_applied", False)
    current_device = torch.cuda.current_device
    yield
    assert torch.cuda.current_device is current_device, "a CPU stand-in leaked into the test process"


def test_cpu_patches_refuse_a_changed_megatron_function_before_changing_anything(without_cuda, monkeypatch):
    from megatron.core.optimizer import clip_grads

    monkeypatch.setattr(clip_grads, "clip_grad_by_total_norm_fp32", lambda *a, **k: None)
    with pytest.raises(UpstreamChangedError, match=r"clip_grads\.clip_grad_by_total_norm_fp32 is not the function"):
        apply_cpu_patches(training=True)


@pytest.mark.parametrize("release", ["2.5.1", "2.14.0", "3.0.0"])
def test_cpu_patches_refuse_a_torch_release_not_checked(without_cuda, monkeypatch, release):
    monkeypatch.setattr(torch, "__version__", release)
    first, last = (".".join(map(str, v)) for v in TORCH_VERSIONS)
    with pytest.raises(
        UpstreamChangedError, match=rf"patched for torch {first} to {last}, not the installed torch {release}"
    ):
        apply_cpu_patches()


def test_torch_patch_releases_pass_the_check(monkeypatch):
    monkeypatch.setattr(torch, "__version__", ".".join(map(str, TORCH_VERSIONS[1])) + ".9+cpu")
    for patch in (*cpu_compat.PATCHES, *cpu_compat.TRAINING_PATCHES):
        if patch.patches_torch:
            patch.check()


# --- batch split, RoPE rows and loss per CP rank (4 forked gloo processes) ------------------


class _CudaFreeOriginal(TorchFunctionMode):
    """Runs Megatron's original RoPE slice on the CPU: it pins memory and calls ``.cuda()``."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func is torch.Tensor.cuda:
            return args[0]
        kwargs = dict(kwargs or {})
        kwargs.pop("pin_memory", None)
        return func(*args, **kwargs)


def _batch(gen, b, s, cp):
    return {
        "tokens": torch.randint(0, 1000, (b, s), generator=gen),
        "labels": torch.randint(0, 1000, (b, s), generator=gen),
        "loss_mask": (torch.rand(b, s, generator=gen) > 0.2).float(),
        "position_ids": torch.arange(s).expand(b, s).clone(),
        "attention_mask": torch.rand(b, 1, s, s, generator=gen) > 0.5,
        "losses": torch.rand(b, s, generator=gen, dtype=torch.float64),
        "cu_seqlens": None,
        "max_seqlen": None,
        "local_cp_size": torch.tensor([cp]),
        "hybrid_cp_group": None,
    }


def _check_layouts(rank, world, seed):
    torch.cuda.current_device = lambda: "cpu"  # RotaryEmbedding moves its table to the "current device"
    from megatron.training import training  # an import site of the batch split

    gen = torch.Generator().manual_seed(seed)
    b, s, stripe = 2, 64, 4
    for cp in (2, 4):  # cp 2 of world 4: two CP groups, each split on its own
        parallel_state.initialize_model_parallel(context_parallel_size=cp)
        group = parallel_state.get_context_parallel_group()
        r = dist.get_rank(group)
        rope = RotaryEmbedding(kv_channels=16, rotary_percent=1.0, cp_group=group)
        full_emb = rope.get_emb(s)
        q = torch.randn(s, b, 3, 16, generator=gen)
        for kind in KINDS:
            where = f"cp={cp} rank={r} {kind}"
            layout = ContextParallelLayout(kind, cp, s, stripe=stripe)
            batch = _batch(gen, b, s, cp)
            megatron_split = ORIGINAL_SPLIT(dict(batch), is_hybrid_cp=False, cp_group=group)
            with _CudaFreeOriginal():
                megatron_emb = ORIGINAL_ROPE(full_emb, 0, group)

            apply_patches(kind, stripe)
            given = dict(batch)
            split = training.get_batch_on_this_cp_rank(given, is_hybrid_cp=False, cp_group=group)
            assert split is given, where  # updated in place, as Megatron's
            for key, value in batch.items():
                if value is None or key == "local_cp_size":
                    assert split[key] is value, (where, key)
                    continue
                want = layout.shard(value, r, dim=2 if key == "attention_mask" else 1)
                assert torch.equal(split[key], want), (where, key)
                if kind == "zigzag":
                    assert split[key].dtype == megatron_split[key].dtype, (where, key)
                    assert torch.equal(split[key], megatron_split[key]), (where, key)

            # RoPE rows through RotaryEmbedding (an import site; its forward cache is cleared on each
            # apply and remove): the rows at the layout's positions.
            emb = rope(s)
            assert torch.equal(emb, full_emb[layout.positions(r)]), where
            if kind == "zigzag":
                assert torch.equal(emb, megatron_emb), where
            rotated = rope_utils._apply_rotary_pos_emb_bshd(layout.shard(q, r, dim=0), emb)
            assert torch.equal(rotated, layout.shard(rope_utils._apply_rotary_pos_emb_bshd(q, full_emb), r, dim=0))

            # A masked token sum all-reduced over CP is the sum over the whole sequence.
            sums = torch.stack([(split["losses"] * split["loss_mask"]).sum(), split["loss_mask"].sum().double()])
            dist.all_reduce(sums, group=group)
            whole = torch.stack([(batch["losses"] * batch["loss_mask"]).sum(), batch["loss_mask"].sum().double()])
            torch.testing.assert_close(sums, whole, rtol=1e-12, atol=0)

            _check_packed(kind, layout, group, r, gen, rope)
            remove_patches()
        parallel_state.destroy_model_parallel()


def _check_packed(kind, layout, group, r, gen, rope):
    """A packed sample splits as one sequence in the layout (``balanced``: placed by its
    documents), its global cu_seqlens whole, THD RoPE rotates each token by its offset inside
    its document and sbhd RoPE takes the rows at the split's positions (random boundaries)."""
    seq = layout.seq_len
    inner = torch.randperm(seq - 1, generator=gen)[: int(torch.randint(1, 6, (1,), generator=gen))] + 1
    cu_seqlens = torch.cat([torch.tensor([0]), inner.sort().values, torch.tensor([seq])]).to(torch.int32)
    layout = dataclasses.replace(layout, documents=cu_seqlens)
    batch = {"tokens": torch.arange(seq).view(1, seq), "cu_seqlens": cu_seqlens}
    split = megatron_utils.get_batch_on_this_cp_rank(dict(batch), is_hybrid_cp=False, cp_group=group)
    assert torch.equal(split["tokens"], layout.shard(batch["tokens"], r)) and split["cu_seqlens"] is cu_seqlens
    # The rotary module's cached rows (the unpacked case's, above) follow the new split.
    assert torch.equal(rope(seq), rope.get_emb(seq)[layout.positions(r)]), kind
    t = torch.randn(seq // layout.cp_size, 2, 8, dtype=torch.float64, generator=gen)
    freqs = torch.randn(seq, 1, 1, 8, dtype=torch.float64, generator=gen)
    rotated = rope_utils._apply_rotary_pos_emb_thd(t, cu_seqlens, freqs, cp_group=group)
    positions = layout.positions(r)
    starts = cu_seqlens.long()[torch.searchsorted(cu_seqlens.long(), positions, right=True) - 1]
    cos, sin = freqs[positions - starts, 0].cos(), freqs[positions - starts, 0].sin()
    half = torch.cat([-t[..., 4:], t[..., :4]], dim=-1)
    torch.testing.assert_close(rotated, t * cos + half * sin, rtol=1e-12, atol=1e-12)


def test_batch_split_rope_and_loss_follow_the_layout(rng):
    """Every layout, cp 2 and 4: each batch key split as ``layout.shard`` (attention_mask on
    dim 2, None and metadata untouched), RoPE rows at ``layout.positions``, rotated q equal to
    the sharded rotated sequence, loss sums over CP unchanged; zigzag equals Megatron's
    functions exactly; packed sequences refused for the other layouts."""
    run(4, _check_layouts, int(torch.randint(0, 2**31, (1,), generator=rng)))


# --- hierarchical ring groups (8 forked gloo processes) ------------------------------------


def _ranks(groups):
    return [dist.get_process_group_ranks(g) for g in groups]


def _check_hierarchies(rank, world):
    members = list(range(world))
    # Before any hierarchical run: Megatron's destroy_model_parallel leaves its hierarchical groups set.
    parallel_state.initialize_model_parallel(context_parallel_size=8)
    with pytest.raises(ValueError, match="hierarchical_context_parallel_sizes=None"):
        hierarchy_from_megatron()
    parallel_state.destroy_model_parallel()

    for inner_size in (4, 2):  # cp 8 as 4x2 and 2x4 from an explicit inner size
        hierarchy = new_hierarchy(inner_size)
        node, local = divmod(rank, inner_size)
        expected = [members[node * inner_size : (node + 1) * inner_size], members[local::inner_size]]
        assert _ranks(hierarchy) == expected and list(_rings(members, rank, hierarchy)) == expected

        parallel_state.initialize_model_parallel(
            context_parallel_size=8, hierarchical_context_parallel_sizes=[inner_size, 8 // inner_size]
        )
        megatron_hierarchy = hierarchy_from_megatron()
        assert _ranks(megatron_hierarchy) == expected
        with pytest.raises(ValueError, match="hierarchical_context_parallel_sizes.*consecutive CP ranks"):
            hierarchy_from_megatron(megatron_hierarchy[::-1])
        parallel_state.destroy_model_parallel()

    # cp 4 as 2x2 in a world of 8: two CP groups, each with its own inner and outer groups;
    # with tp 2 a CP group's global ranks are not consecutive ([0, 2, 4, 6] on nodes of 4).
    for tp in (1, 2):
        parallel_state.initialize_model_parallel(
            tensor_model_parallel_size=tp, context_parallel_size=4, hierarchical_context_parallel_sizes=[2, 2]
        )
        cp_group = parallel_state.get_context_parallel_group()
        cp_members = dist.get_process_group_ranks(cp_group)
        explicit = new_hierarchy(inner_size_from_nodes(cp_group, ranks_per_node=2 * tp), cp_group)
        assert _ranks(explicit) == _ranks(hierarchy_from_megatron()), (tp, cp_members)
        assert list(_rings(cp_members, dist.get_rank(cp_group), explicit)) == _ranks(explicit)
        parallel_state.destroy_model_parallel()

    parallel_state.initialize_model_parallel(context_parallel_size=8, hierarchical_context_parallel_sizes=[2, 2, 2])
    with pytest.raises(ValueError, match=r"hierarchical_context_parallel_sizes=\[2, 2, 2\].*two sizes"):
        hierarchy_from_megatron()
    parallel_state.destroy_model_parallel()

    os.environ["LOCAL_WORLD_SIZE"] = "4"
    assert inner_size_from_nodes() == 4
    with pytest.raises(ValueError, match="ranks_per_node=3"):
        inner_size_from_nodes(ranks_per_node=3)
    # Bad values fail on every rank alike (no rank is left waiting in a collective).
    with pytest.raises(ValueError, match="inner_size=3.*a divisor of cp_size"):
        new_hierarchy(3)
    with pytest.raises(ValueError, match=r"inner_size=.*the same value on every rank \(got \[2, 4\]\)"):
        new_hierarchy(2 if rank == 0 else 4)


class _Killed(BaseException):
    """Stands for a SIGKILL between the tracker's opening for writing and its write."""


@pytest.mark.parametrize("atomic", [True, False], ids=["patched", "megatron"])
def test_tracker_write_interrupted_keeps_the_previous_tracker(tmp_path, atomic):
    """Megatron's own write truncates the tracker first: interrupted, it leaves an empty file
    on which the next start's ``read_metadata`` exits. The patched write leaves the previous
    tracker, then replaces it whole."""
    from megatron.core.msc_utils import maybe_msc
    from megatron.training.checkpointing import get_checkpoint_tracker_filename, read_metadata

    from megatron_mtraining.patches import use_atomic_checkpoint_tracker

    tracker = get_checkpoint_tracker_filename(str(tmp_path))
    previous, latest = (int(i) for i in torch.randint(1, 10**6, (2,)))
    Path(tracker).write_text(str(previous))
    if atomic:
        use_atomic_checkpoint_tracker()
    try:
        with pytest.raises(_Killed), maybe_msc.open(tracker, "w"):
            raise _Killed
        if not atomic:
            assert Path(tracker).read_text() == ""
            with pytest.raises(SystemExit):
                read_metadata(tracker)
            return
        assert read_metadata(tracker) == (previous, False)
        with maybe_msc.open(tracker, "w") as f:
            f.write(str(latest))
        assert read_metadata(tracker) == (latest, False)
        assert sorted(p.name for p in tmp_path.iterdir()) == [atomic_tracker.TRACKER]
        # Other files keep the plain open.
        with maybe_msc.open(str(tmp_path / "other.txt"), "w") as f:
            assert isinstance(f, io.TextIOWrapper)
    finally:
        atomic_tracker.PATCH.uninstall()
    assert maybe_msc.open is open


def test_hierarchical_groups_have_the_ring_order():
    """cp 8 as 4x2 and 2x4, cp 4 as 2x2 (two CP groups): explicit inner size, ranks per node
    and Megatron's hierarchical_context_parallel_sizes give the ranks ``_rings`` expects;
    bad sizes and orders are errors naming the field."""
    run(8, _check_hierarchies)
