"""The plugin's attention settings, and how they travel with a Megatron ``TransformerConfig``.

``MTrainingAttentionConfig`` holds everything Megatron's own config has no field for: the
attention type, the pattern parameters, the context-parallel token layout and the ring
hierarchy. It validates itself on construction; every error names the field, the value and
what is accepted. Pattern sections can be given as the ``megatron_mtraining.sparse`` config
objects or as plain dicts (from YAML), whose unknown keys are rejected by name.

Megatron builds every module from one ``TransformerConfig`` instance, so the plugin config is
attached to that instance as the attribute ``mtraining_attention``
(:func:`attach_attention_config`) and read back by the modules (:func:`get_attention_config`).
The attribute survives ``copy.deepcopy`` (Megatron deep-copies the config for GQA with fewer
KV heads than TP ranks), but not ``dataclasses.replace``: attach after the last replace.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from .. import patterns
from ..context_parallel.layout import KINDS, STRIPED_KINDS, ContextParallelLayout
from ..context_parallel.ring import KV_EXCHANGES
from ..patterns.base import Pattern
from ..sparse import dispatch
from ..sparse.validation import ValidatedConfig, check_choice, check_int, fail, setting

ATTENTION_TYPES = patterns.names()
# ``sparse_attention``'s settings; None is its ``auto``.
BACKENDS = (None, *(b for b in dispatch.BACKENDS if b != "auto"))
# Libraries that compute whole causal attention only: dense type, no context parallelism.
DENSE_ONLY_BACKENDS = ("flash_attn", "sdpa")
# Library calls over wide top-k blocks (MoBA's chunks) on one device.
WIDE_BLOCK_BACKENDS = ("varlen_blocks",)
CONFIG_ATTRIBUTE = "mtraining_attention"


def _check_hierarchy(name: str, value) -> None:
    if value is not None:
        check_int(name, value, minimum=1)


def _check_backend(name: str, value) -> None:
    if value not in BACKENDS:
        fail(
            name,
            value,
            "None (automatic: for dense attention on a GPU flash-attn where installed, else PyTorch's fused "
            "attention; Triton kernels for the other CUDA calls), " + ", ".join(repr(b) for b in BACKENDS[1:]),
        )


def _check_pattern(name: str, value, *, cls) -> None:
    if not isinstance(value, cls):
        fail(name, type(value).__name__, f"a {cls.__name__} or a dict of its fields")


def _pattern_from_dict(cls, values: dict, where: str):
    known = {f.name for f in dataclasses.fields(cls)}
    for key in values:
        if key not in known:
            fail(f"{where}.{key}", values[key], f"one of the {cls.__name__} fields: {', '.join(sorted(known))}")
    return cls(**values)


@dataclass(frozen=True)
class _AttentionSettings(ValidatedConfig):
    """Attention type, pattern parameters and context-parallel layout of a model.

    ``type`` selects the pattern (``megatron_mtraining.patterns``); only its section (the
    field named after it, holding the pattern's settings dataclass, e.g. ``mtraining``,
    ``msa``, ``moba``) is used. ``layout`` is the token order of a context-parallel rank (``zigzag`` is Megatron's
    own batch split; ``striped``, ``balanced`` and ``contiguous`` need the plugin's batch-split and RoPE
    patches, ``megatron_mtraining.patches.apply_patches``; ``balanced`` places each packed
    sample's stripes by its documents and is ``striped`` without them), ``stripe``
    its stripe length. ``hierarchy`` is the inner (intra-node) ring size of the hierarchical
    ring, or None for the flat ring; it must match Megatron's
    ``hierarchical_context_parallel_sizes = [hierarchy, cp_size // hierarchy]``, which creates
    the groups. ``kv_exchange`` is how K/V reach a rank's queries under context parallelism
    (``ring_attention``'s: ``auto``, the all-gather on a flat group whose ranks share a node
    and the ring otherwise; ``ring``; ``allgather``: with a hierarchy, gathered inside each
    node and passed round the nodes, the layout's ranks then numbered node-major,
    ``layout_node_size``). ``backend`` forces the sparse attention backend (None: as ``sparse_attention``'s
    ``auto``: for dense attention on CUDA flash-attn where it is installed, else PyTorch's
    fused attention (cuDNN / FlashAttention-2); Triton kernels for the other CUDA calls,
    the PyTorch reference otherwise); ``flash_attn`` and ``sdpa`` only for ``type="dense"``
    without context parallelism, the one case those libraries compute.
    """

    type: str = setting("dense", check_choice, choices=ATTENTION_TYPES)
    layout: str = setting("zigzag", check_choice, choices=KINDS)
    stripe: int = setting(128, check_int, minimum=1)
    hierarchy: int | None = setting(None, _check_hierarchy)
    kv_exchange: str = setting("auto", check_choice, choices=KV_EXCHANGES)
    backend: str | None = setting(None, _check_backend)

    def __post_init__(self):
        for pattern in patterns.with_settings():
            value = getattr(self, pattern.name)
            if isinstance(value, dict):
                where = f"{type(self).__name__}.{pattern.name}"
                object.__setattr__(self, pattern.name, _pattern_from_dict(pattern.settings, value, where))
        super().__post_init__()
        if self.backend in DENSE_ONLY_BACKENDS and self.type != "dense":
            fail(
                f"{type(self).__name__}.backend",
                self.backend,
                f"None, 'reference' or 'triton' for type '{self.type}' ({self.backend} computes dense attention only)",
            )
        if self.backend in WIDE_BLOCK_BACKENDS and self.type != "moba":
            fail(
                f"{type(self).__name__}.backend",
                self.backend,
                f"None, 'reference' or 'triton' for type '{self.type}' ({self.backend} runs MoBA's wide blocks only)",
            )

    @classmethod
    def from_dict(cls, values: dict, where: str = "attention") -> MTrainingAttentionConfig:
        """From a YAML-style mapping; an unknown key fails naming ``where.key``."""
        if not isinstance(values, dict):
            fail(where, type(values).__name__, "a mapping of attention settings")
        known = {f.name for f in dataclasses.fields(cls)}
        for key in values:
            if key not in known:
                fail(f"{where}.{key}", values[key], f"one of the attention settings: {', '.join(sorted(known))}")
        parsed = dict(values)
        for pattern in patterns.with_settings():
            if isinstance(parsed.get(pattern.name), dict):
                parsed[pattern.name] = _pattern_from_dict(
                    pattern.settings, parsed[pattern.name], f"{where}.{pattern.name}"
                )
        return cls(**parsed)

    @property
    def layout_node_size(self) -> int | None:
        """The layout's ``node_size`` (its ranks numbered node-major): the hierarchy's inner size
        where K/V are gathered inside nodes (``kv_exchange='allgather'`` with a hierarchy), which
        that numbering balances; None (flat) otherwise. The patches take it too
        (``apply_patches``), so that the batch split and RoPE follow the attention's layout."""
        return self.hierarchy if self.kv_exchange == "allgather" else None

    def cp_layout(self, cp_size: int, seq_length: int, documents=None) -> ContextParallelLayout:
        """The layout of a sequence of ``seq_length`` tokens over ``cp_size`` ranks."""
        return ContextParallelLayout(
            self.layout, cp_size, seq_length, stripe=self.stripe, documents=documents, node_size=self.layout_node_size
        )

    @property
    def pattern_class(self) -> type[Pattern]:
        """The registered pattern of ``type``."""
        return patterns.get(self.type)

    @property
    def settings(self):
        """The settings of ``type`` (its section), or None for a pattern without settings."""
        return getattr(self, self.type) if self.pattern_class.settings is not None else None

    @property
    def pattern(self) -> Pattern:
        """The pattern of ``type`` bound to its settings: what the core attention and the ring build indices with."""
        return self.pattern_class(self.settings)

    def validate_for_sequence(self, seq_length: int, cp_size: int) -> None:
        """Checks against the training sequence (done when the config is read, so a layout that
        cannot split it fails before any process starts, and a pattern that would attend
        everything does not run dense without a word)."""
        name = type(self).__name__
        if cp_size > 1 and self.layout in STRIPED_KINDS and seq_length % cp_size == 0:
            local = seq_length // cp_size
            if local % self.stripe:
                divisors = [d for d in range(1, local + 1) if local % d == 0]
                fail(
                    f"{name}.stripe",
                    self.stripe,
                    f"a divisor of seq_length / context_parallel_size = {seq_length} / {cp_size} = {local}: "
                    f"{', '.join(map(str, divisors))}",
                )
        self._check_stripe_tiles(cp_size)
        if cp_size > 1:
            try:
                self.cp_layout(cp_size, seq_length)
            except ValueError as err:
                raise ValueError(
                    f"seq_length={seq_length} cannot be split over context_parallel_size={cp_size} ranks: {err}"
                ) from None
        self.pattern_class.check_sequence(self.settings, seq_length, f"{name}.{self.type}")

    def _check_stripe_tiles(self, cp_size: int) -> None:
        """Under context parallelism a striped layout's stripes are whole tiles of the ring's
        kernels for the pattern; any other stripe would send every ring step to the PyTorch
        reference path, orders of magnitude slower on a GPU, without a word."""
        if cp_size <= 1 or self.layout not in STRIPED_KINDS or self.backend == "reference":
            return
        tiles = self.pattern_class.ring_tiles(self.settings)
        if any(self.stripe % t == 0 for t in tiles):
            return
        field = self.pattern_class.size_field
        source = "" if field is None else f" ({self.type}.{field} = {getattr(self.settings, field)})"
        fail(
            f"{type(self).__name__}.stripe",
            self.stripe,
            f"a multiple of {min(tiles)} for type '{self.type}'{source} under context parallelism: the ring's "
            f"kernels take a rank's tokens in whole tiles of {', '.join(map(str, tiles))} tokens",
        )

    def validate_for(self, config) -> None:
        """Checks against a Megatron ``TransformerConfig`` (done when attaching, so a bad
        combination fails at start-up rather than in the first forward)."""
        if config.attention_dropout:
            fail(
                "TransformerConfig.attention_dropout", config.attention_dropout, "0.0 (sparse attention has no dropout)"
            )
        if config.softmax_type != "vanilla":
            fail("TransformerConfig.softmax_type", config.softmax_type, "'vanilla' (no attention sinks in the kernels)")
        if config.window_size is not None:
            fail("TransformerConfig.window_size", config.window_size, "None (the pattern decides what is attended)")
        if self.pattern_class.has_index_branch and config.tensor_model_parallel_size > 1:
            # The index projections are replicated modules; with TP their per-rank KL would
            # need TP-sharded index heads and a TP all-reduce of the shared key projection.
            fail(
                "TransformerConfig.tensor_model_parallel_size",
                config.tensor_model_parallel_size,
                f"1 for type '{self.type}'",
            )
        cp = config.context_parallel_size
        if self.backend in (*DENSE_ONLY_BACKENDS, *WIDE_BLOCK_BACKENDS) and cp > 1:
            # These compute whole causal attention; the ring's steps attend parts of it.
            fail(
                "TransformerConfig.context_parallel_size", cp, f"1 with {type(self).__name__}.backend={self.backend!r}"
            )
        self._check_stripe_tiles(cp)
        sizes = config.hierarchical_context_parallel_sizes
        if self.hierarchy is not None and cp > 1:
            want = [self.hierarchy, cp // self.hierarchy]
            if cp % self.hierarchy:
                fail(f"{type(self).__name__}.hierarchy", self.hierarchy, f"a divisor of context_parallel_size ({cp})")
            if list(sizes or []) != want:
                fail(
                    "TransformerConfig.hierarchical_context_parallel_sizes",
                    sizes,
                    f"{want} (inner, outer) for {type(self).__name__}.hierarchy={self.hierarchy}",
                )


MTrainingAttentionConfig = dataclasses.make_dataclass(
    "MTrainingAttentionConfig",
    [
        (pattern.name, pattern.settings, setting(pattern.settings(), _check_pattern, cls=pattern.settings))
        for pattern in patterns.with_settings()
    ],
    bases=(_AttentionSettings,),
    frozen=True,
    module=__name__,
)
# The settings sections come from the pattern registry, so a new pattern needs no field here.
MTrainingAttentionConfig.__doc__ = _AttentionSettings.__doc__


def attach_attention_config(config, attention: MTrainingAttentionConfig):
    """Validates ``attention`` against the Megatron ``config`` and attaches it (attribute
    ``mtraining_attention``). For MSA it also installs the KL loss scale hook
    ``config.experimental_attention_variant_loss_scale_func`` that Megatron's schedules call
    every microbatch. Returns ``config``."""
    if not isinstance(attention, MTrainingAttentionConfig):
        fail("attention", type(attention).__name__, "an MTrainingAttentionConfig")
    attention.validate_for(config)
    if attention.pattern_class.has_index_branch:
        from .msa_loss import MSALossAutoScaler

        hook = config.experimental_attention_variant_loss_scale_func
        if hook is not None and hook != MSALossAutoScaler.set_loss_scale:
            fail(
                "TransformerConfig.experimental_attention_variant_loss_scale_func",
                hook,
                "None or MSALossAutoScaler.set_loss_scale (the MSA KL loss needs Megatron's loss scale)",
            )
        config.experimental_attention_variant_loss_scale_func = MSALossAutoScaler.set_loss_scale
    setattr(config, CONFIG_ATTRIBUTE, attention)
    return config


def get_attention_config(config) -> MTrainingAttentionConfig:
    """The plugin config attached to a Megatron ``TransformerConfig``."""
    attention = getattr(config, CONFIG_ATTRIBUTE, None)
    if attention is None:
        fail(
            f"TransformerConfig.{CONFIG_ATTRIBUTE}",
            None,
            "an MTrainingAttentionConfig attached with attach_attention_config(config, attention) before the "
            "model is built",
        )
    return attention
