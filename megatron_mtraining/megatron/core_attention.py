"""The core-attention module that puts the plugin's sparse attention in a Megatron layer.

:class:`SparseCoreAttention` takes ``DotProductAttention``'s place in a ``SelfAttention``
(the ``core_attention`` slot of a layer spec) and keeps its contract: the same constructor
keywords, ``query [sq, b, np, hn]`` and ``key/value [sk, b, ng, hn]`` in (after RoPE; GQA
with ``ng`` KV heads), ``[sq, b, np * hn]`` out. It converts the layout to the sparse API's
``[b, s, h, d]`` once, builds the pattern that the config attached to the
``TransformerConfig`` names, and runs the sparse ring over the context-parallel group (or the
single-device kernel when that group has one rank). Attention is causal; the sequence a
context-parallel rank holds is in the configured layout's token order, which Megatron's batch
split and RoPE slice give: zigzag is Megatron's own order, any other layout needs
``megatron_mtraining.patches.apply_patches(layout, stripe)`` before the model is built (checked).

MSA's index branch lives here too, so one module owns selection, attention and the KL loss.
It reads the layer input, which ``DotProductAttention``'s forward does not receive:
:class:`MSASelfAttention` hands it over, detached, without changing that forward.
"""

from __future__ import annotations

import dataclasses
import math

import torch
from megatron.core import parallel_state
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.transformer.attention import SelfAttention
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule
from megatron.core.utils import divide

from .. import patches
from ..context_parallel import ContextParallelLayout, ring_attention
from ..context_parallel.distributed_index import build_index
from ..context_parallel.layout import STRIPED_KINDS
from ..sparse import DenseIndex, IndexBranch, msa_attention, sparse_attention
from ..sparse.documents import packed_documents
from ..sparse.index import SparseIndex
from ..sparse.validation import fail
from .config import get_attention_config
from .cp_groups import hierarchy_from_megatron
from .kept_indexes import KeptIndexes, recomputes_core_attention
from .msa_loss import ITERATION_ATTRIBUTE, MSALossAutoScaler, msa_layer_kl, record_kl, training_iteration
from .profiler_ranges import part_range


def _group_size(group) -> int:
    return group.size() if group is not None else 1


class SparseCoreAttention(MegatronModule):
    """Causal sparse attention with ``DotProductAttention``'s constructor and forward.

    ``attention`` (from the layer spec's params) is the type the spec was built for; it must
    equal the attached config's ``type``. Dropout is not supported (``attention_dropout``
    must be 0). ``cp_comm_type`` is accepted and unused: context parallelism runs the plugin's
    ring or all-gather, as ``MTrainingAttentionConfig.kv_exchange`` says. Parameters exist only for MSA (``index_branch``); this class derives from
    ``MegatronModule`` rather than ``DotProductAttention``, so the default
    ``sharded_state_dict`` already checkpoints them (``DotProductAttention``'s override would
    emit only ``softmax_offset``).
    """

    def __init__(
        self,
        config,
        layer_number: int,
        attn_mask_type: AttnMaskType,
        attention_type: str,
        attention_dropout: float | None = None,
        softmax_scale: float | None = None,
        cp_comm_type: str | None = None,
        pg_collection: ProcessGroupCollection | None = None,
        attention: str | None = None,
        **kwargs,
    ):
        super().__init__(config=config)
        self.attention_config = get_attention_config(config)
        if attention is not None and attention != self.attention_config.type:
            fail(
                "MTrainingAttentionConfig.type",
                self.attention_config.type,
                f"'{attention}', the attention type the layer spec was built for",
            )
        if attention_type != "self":
            fail("attention_type", attention_type, "'self' (sparse attention is causal self-attention)")
        self.attn_mask_type = self._check_mask_type(attn_mask_type)
        if attention_dropout:
            fail("attention_dropout", attention_dropout, "0.0 (sparse attention has no dropout)")
        self.attention_config.validate_for(config)
        if pg_collection is None:
            pg_collection = ProcessGroupCollection.use_mpu_process_groups(required_pgs=["tp", "cp"])
        self.pg_collection = pg_collection
        self.tp_group = pg_collection.tp
        self.cp_group = getattr(pg_collection, "cp", None) or parallel_state.get_context_parallel_group(
            check_initialized=False
        )
        self.hierarchy = self._hierarchy_groups(pg_collection)
        self._check_patches(_group_size(self.cp_group))
        self.layer_number = max(1, layer_number)
        # Megatron's query-key layer scaling divides the scale by the layer number and
        # multiplies the scores back in the softmax: the net scale is unchanged.
        self.softmax_scale = 1.0 / math.sqrt(config.kv_channels) if softmax_scale is None else softmax_scale
        self.index_input = None  # the layer input, set by MSASelfAttention for one forward
        self._recomputed = recomputes_core_attention(config)
        self._kept_indexes = KeptIndexes()
        # The config is frozen: its pattern, bound to its settings, is built once.
        self.pattern = self.attention_config.pattern
        if self.pattern.has_index_branch:
            groups = divide(config.num_query_groups, _group_size(self.tp_group))
            device = "cpu" if config.use_cpu_initialization else torch.cuda.current_device()
            self.index_branch = IndexBranch(
                config.hidden_size, groups, self.attention_config.msa, init_std=config.init_method_std
            ).to(device=device, dtype=config.params_dtype)

    @staticmethod
    def _check_mask_type(mask_type: AttnMaskType) -> AttnMaskType:
        if mask_type != AttnMaskType.causal:
            fail("attn_mask_type", mask_type, "AttnMaskType.causal (sparse attention is causal)")
        return mask_type

    def _hierarchy_groups(self, pg_collection):
        """(inner, outer) groups of the hierarchical ring: Megatron's hierarchical CP groups."""
        inner_size = self.attention_config.hierarchy
        if inner_size is None or _group_size(self.cp_group) == 1:
            return None
        # Equal sizes are not enough: the ring numbers CP ranks node-major, so the groups'
        # rank order is checked too.
        try:
            inner, outer = hierarchy_from_megatron(getattr(pg_collection, "hcp", None), self.cp_group)
        except ValueError as err:
            raise ValueError(f"{err} (for attention.hierarchy={inner_size})") from err
        if inner.size() != inner_size:
            fail(
                "hierarchical CP groups",
                [inner.size(), outer.size()],
                f"[{inner_size}, {_group_size(self.cp_group) // inner_size}] from initialize_model_parallel("
                f"hierarchical_context_parallel_sizes=...) for MTrainingAttentionConfig.hierarchy={inner_size}",
            )
        return inner, outer

    def _check_patches(self, cp_size: int, layout: ContextParallelLayout | None = None) -> None:
        """The ring assumes every CP rank holds its tokens in the configured layout's order;
        Megatron's batch split and RoPE slice decide that order, so they must agree (with a
        forward's ``layout`` under ``balanced``, on the micro-batch's documents too)."""
        if cp_size == 1:
            return
        cfg = self.attention_config
        applied = patches.applied_layout()
        if cfg.layout == "zigzag" and cfg.layout_node_size is None:
            # Megatron's own split is zigzag, and zigzag patches reproduce it.
            if applied is None or (applied.kind == "zigzag" and applied.node_size is None):
                return
            raise ValueError(
                f"attention.layout='zigzag' does not match the Megatron patches, which split CP batches and RoPE in "
                f"the {applied.kind!r} layout (stripe {applied.stripe}): set attention.layout={applied.kind!r} "
                f"(and attention.stripe={applied.stripe}), or call megatron_mtraining.patches.remove_patches() "
                "before building the model"
            )
        if (
            applied is not None
            and applied.kind == cfg.layout
            and (cfg.layout not in STRIPED_KINDS or applied.stripe == cfg.stripe)
            and applied.node_size == cfg.layout_node_size
        ):
            if layout is not None and cfg.layout == "balanced":
                self._check_split_documents(layout)
            return
        node_size = cfg.layout_node_size
        want = f"megatron_mtraining.patches.apply_patches({cfg.layout!r}, {cfg.stripe}"
        want += ")" if node_size is None else f", node_size={node_size})"
        if applied is None:
            got = "are not applied, so Megatron splits CP batches and RoPE in its zigzag order"
        else:
            got = f"are applied with layout {applied.kind!r} and stripe {applied.stripe}"
            got += "" if applied.node_size is None else f" and node_size {applied.node_size}"
        numbered = (
            ""
            if node_size is None
            else f" (ranks numbered node-major in nodes of {node_size}: K/V gathered inside nodes)"
        )
        raise ValueError(
            f"attention.layout={cfg.layout!r}, attention.stripe={cfg.stripe}{numbered} needs Megatron's CP batch split and RoPE "
            f"slice in the same layout, but the patches {got}: call {want} before building the model"
            + ("" if applied is None else " (remove_patches() first)")
        )

    @staticmethod
    def _check_split_documents(layout: ContextParallelLayout) -> None:
        """``balanced`` places a micro-batch by its documents: those the batch split used must
        be the attention's, or every token would be taken for another position."""
        split = dataclasses.replace(layout, documents=patches.split_documents()).documents
        if split != layout.documents:
            ends = "" if split is None else ", ".join(map(str, split[1:9])) + (", ..." if len(split) > 9 else "")
            fail(
                "the documents of Megatron's CP batch split",
                "no documents (striped)" if split is None else f"{len(split) - 1} documents, ends [{ends}]",
                "the attention's packed_seq_params.cu_seqlens_q"
                + ("" if layout.documents is None else f" ({len(layout.documents) - 1} documents)")
                + " under attention.layout='balanced': put the sample's cu_seqlens in the batch (batch['cu_seqlens'])"
                " before get_batch_on_this_cp_rank, and pass the same boundaries as packed_seq_params",
            )

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: torch.Tensor | None,
        attn_mask_type: AttnMaskType | None = None,
        attention_bias: torch.Tensor | None = None,
        packed_seq_params=None,
        index_input: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """``[sq, b, np, hn]`` queries over ``[sk, b, ng, hn]`` keys/values -> ``[sq, b, np*hn]``
        (``[t, np, hn]`` -> ``[t, 1, np*hn]`` for packed ``thd`` input).

        ``attention_mask`` is not read: the attention is causal over global positions, which
        the layout gives (as Transformer Engine ignores the mask for a causal mask type).
        ``packed_seq_params``: packed documents (``training/documents.py`` builds them from the
        EOD tokens), ``thd`` or ``sbhd`` with batch 1, ``cu_seqlens_q`` the global document
        boundaries of the whole sample; no query attends across one.
        ``index_input``: the layer input ``[s, b, hidden]`` for MSA's index branch when the
        caller passes it explicitly (recompute); otherwise ``self.index_input``.
        """
        if attention_bias is not None:
            fail("attention_bias", type(attention_bias).__name__, "None (no additive bias in sparse attention)")
        self._check_mask_type(attn_mask_type or self.attn_mask_type)
        if packed_seq_params is not None and packed_seq_params.qkv_format == "thd":
            query, key, value = (t.unsqueeze(1) for t in (query, key, value))
        cu_seqlens = _packed_bounds(packed_seq_params, query.shape[1])
        q, k, v = (t.transpose(0, 1).contiguous() for t in (query, key, value))
        cp_size = _group_size(self.cp_group)
        layout = None
        if cp_size > 1:
            cfg = self.attention_config
            # balanced places the tokens by the documents (their bounds read on the host).
            layout = cfg.cp_layout(cp_size, q.shape[1] * cp_size, documents=cu_seqlens)
            # Again per forward: removing or changing the patches after the build would
            # silently misplace every token.
            self._check_patches(cp_size, layout)
        if self.pattern.has_index_branch:
            hidden = index_input if index_input is not None else self.index_input
            out = self._msa(q, k, v, hidden, layout, cu_seqlens)
        else:
            out, _ = self._attend(q, k, v, self.pattern, layout, cu_seqlens)
        return out.transpose(0, 1).reshape(out.shape[1], out.shape[0], -1)

    def _source(self, pattern, q, k, layout, cu_seqlens=None):
        """``pattern`` (an index is returned as it is) as the source of this rank's index:
        under activation recomputation built by the first run and kept for the recompute
        (``KeptIndexes``)."""
        if isinstance(pattern, SparseIndex):
            return pattern
        # The packed boundaries travel through the checkpoint as the same tensor.
        bounds = None if cu_seqlens is None else (cu_seqlens.data_ptr(), cu_seqlens.numel())
        key = (getattr(self.config, ITERATION_ATTRIBUTE, None), q.shape, k.shape, layout, bounds)
        return self._kept_indexes.source(pattern, key, self.training and self._recomputed)

    def _attend(self, q, k, v, pattern, layout, cu_seqlens=None) -> tuple[torch.Tensor, torch.Tensor]:
        """(out, lse ``[B, Hq, L]`` fp32) of this rank's rows; ``cu_seqlens``: packed documents."""
        scale, backend = self.softmax_scale, self.attention_config.backend
        source = self._source(pattern, q, k, layout, cu_seqlens)
        if layout is None:
            with part_range("index"):
                index = build_index(source, q, k, scale, cu_seqlens=cu_seqlens)
            return sparse_attention(q, k, v, index, softmax_scale=scale, backend=backend)
        exchange = self.attention_config.kv_exchange
        return ring_attention(
            q, k, v, source, layout, self.cp_group, self.hierarchy, scale, backend=backend, kv_exchange=exchange,
            cu_seqlens=cu_seqlens,
        )  # fmt: skip

    def _msa(self, q, k, v, hidden, layout, cu_seqlens=None) -> torch.Tensor:
        """MSA: select with the index branch (dense during warmup), attend, and attach this
        rank's share of the KL loss to the output while training."""
        if hidden is None:
            fail(
                "index_input",
                None,
                "the layer input: build MSA layers with get_gpt_layer_spec(attention='msa'), whose "
                "MSASelfAttention hands it to the core attention",
            )
        cfg = self.attention_config.msa
        with part_range("msa_index"):
            q_idx, k_idx = self.index_branch(hidden.transpose(0, 1))
            if cfg.warmup_steps > 0 and cfg.in_warmup(training_iteration(self.config)):
                # Dense main branch; the KL spans every visible token.
                seq = q.shape[1] if layout is None else layout.seq_len
                documents = packed_documents(cu_seqlens, seq, q.device)
                index = DenseIndex(q.shape[0], q.shape[2], seq, device=q.device, documents=documents)
            else:
                source = self._source(self.pattern.with_inputs(q_idx, k_idx), q, k, layout, cu_seqlens)
                index = build_index(source, q, k, self.softmax_scale, layout, self.cp_group, cu_seqlens)
        self._msa_metrics(q, k, q_idx, k_idx, index, layout)
        if not (self.training and torch.is_grad_enabled()):
            return self._attend(q, k, v, index, layout, cu_seqlens)[0]
        backend = self.attention_config.backend
        if layout is None:
            # Attention and KL in one call, so that on the KV-outer kernels the attention's
            # backward hands the KL its teacher (the step report then counts that KL as
            # attention; a KL of its own runs in the msa_kl range).
            self._index_metrics(q, k, index, cu_seqlens)
            out, _, kl = msa_attention(
                q, k, v, q_idx, k_idx, index, self.softmax_scale, self._record_kl, backend,
                kl_scope=lambda: part_range("msa_kl"),
            )  # fmt: skip
        else:
            out, lse = self._attend(q, k, v, index, layout, cu_seqlens)
            with part_range("msa_kl"):
                # The main pass's LSE normalises the teacher (the ring runs no KL forward and
                # records the value from the backward).
                kl = msa_layer_kl(
                    q, k, q_idx, k_idx, index, self.softmax_scale, layout, self.cp_group,
                    lse=lse, on_value=self._record_kl, backend=backend,
                )  # fmt: skip
        return MSALossAutoScaler.apply(out, kl * cfg.kl_coeff)

    def _msa_metrics(self, q, k, q_idx, k_idx, index, layout) -> None:
        """Called by :meth:`_msa` with the selection before the main branch runs: a hook for
        ``training.attention_metrics.MeasuredCoreAttention`` (MSA's recall); nothing here."""

    def _index_metrics(self, q, k, index, cu_seqlens=None) -> None:
        """Called with a single-device index before attention that bypasses :meth:`_attend`
        (:meth:`_msa` in training): a hook for ``MeasuredCoreAttention`` (the attended
        fraction and recalls, which its ``_attend`` records otherwise); nothing here."""

    def _record_kl(self, value: torch.Tensor) -> None:
        record_kl(value, self.layer_number, self.config.num_layers, self.cp_group)


def _packed_bounds(packed_seq_params, batch: int) -> torch.Tensor | None:
    """The global document boundaries of a packed sample, or None (unpacked); fails naming
    what the plugin's packed path does not take."""
    if packed_seq_params is None:
        return None
    p = packed_seq_params
    if p.qkv_format not in ("thd", "sbhd"):
        fail("packed_seq_params.qkv_format", p.qkv_format, "'thd' or 'sbhd'")
    if batch != 1:
        fail("micro-batch size", batch, "1 with packed documents (one packed sample per micro-batch)")
    if p.cu_seqlens_q is None:
        fail("packed_seq_params.cu_seqlens_q", None, "the document boundaries of the sample")
    for name in ("cu_seqlens_kv", "cu_seqlens_q_padded", "cu_seqlens_kv_padded"):
        other = getattr(p, name)
        if other is not None and other is not p.cu_seqlens_q and not torch.equal(other, p.cu_seqlens_q):
            fail(f"packed_seq_params.{name}", "different boundaries", "None or cu_seqlens_q (self-attention, unpadded)")
    return p.cu_seqlens_q


class MSASelfAttention(SelfAttention):
    """``SelfAttention`` that also gives its core attention the layer input, detached (MSA's
    index branch reads it; only the KL loss may train the branch). The rest of the layer is
    Megatron's own."""

    def forward(self, hidden_states, *args, **kwargs):
        self.core_attention.index_input = hidden_states.detach()
        try:
            return super().forward(hidden_states, *args, **kwargs)
        finally:
            self.core_attention.index_input = None

    def _checkpointed_attention_forward(self, *args, core_attention_extra_kwargs=None, **kwargs):
        # Recompute runs the core attention again in the backward, after forward returned and
        # cleared index_input: pass the input through the checkpoint instead.
        extra = {**(core_attention_extra_kwargs or {}), "index_input": self.core_attention.index_input}
        return super()._checkpointed_attention_forward(*args, core_attention_extra_kwargs=extra, **kwargs)
