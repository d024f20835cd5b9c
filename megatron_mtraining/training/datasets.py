"""The datasets ``megatron.training.pretrain`` asks for: Megatron's GPT datasets, random
tokens with ``mock_data``, else the indexed ``data_path``."""

from __future__ import annotations

from megatron.core import parallel_state
from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig, MockGPTDataset
from megatron.training import get_args, get_tokenizer
from megatron.training.utils.common_utils import get_blend_and_blend_per_split, print_rank_0


def _dataset_config(args) -> GPTDatasetConfig:
    blend, blend_per_split = get_blend_and_blend_per_split(args)
    return GPTDatasetConfig(
        random_seed=args.seed,
        sequence_length=args.seq_length,
        blend=blend,
        blend_per_split=blend_per_split,
        split=args.split,
        num_dataset_builder_threads=args.num_dataset_builder_threads,
        path_to_cache=args.data_cache_path,
        mmap_bin_files=args.mmap_bin_files,
        tokenizer=get_tokenizer(),
        reset_position_ids=args.reset_position_ids,
        reset_attention_mask=args.reset_attention_mask,
        eod_mask_loss=args.eod_mask_loss,
        create_attention_mask=args.create_attention_mask_in_dataloader,
    )


def _built_on_this_rank() -> bool:
    first_or_last = parallel_state.is_pipeline_first_stage() or parallel_state.is_pipeline_last_stage()
    return first_or_last and parallel_state.get_tensor_model_parallel_rank() == 0


def train_valid_test_datasets_provider(num_samples):
    """Megatron's GPT datasets: random tokens with ``mock_data``, else the indexed ``data_path``."""
    args = get_args()
    dataset_type = MockGPTDataset if args.mock_data else GPTDataset
    print_rank_0(f"> building {dataset_type.__name__} train, validation and test datasets")
    return BlendedMegatronDatasetBuilder(dataset_type, num_samples, _built_on_this_rank, _dataset_config(args)).build()


# Every rank calls the provider (Megatron then builds the data loaders where a dataset exists).
train_valid_test_datasets_provider.is_distributed = True
