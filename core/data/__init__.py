"""Data for multimodal training through megatron-energon: a synthetic sample dataset, tokenizers, the task encoder
that turns captioning samples into micro-batches, lane merging of encoder inputs, skip accounting, and the lane
loader that feeds a rank's lanes (resumable, routed by energon's global worker id)."""

from .lane_loader import LaneLoader
from .lanes import merge_encoder_inputs, merge_lane_batches, merge_modality_inputs, merge_packed_seq_params
from .loader import get_multimodal_train_loader, make_worker_config
from .sample_dataset import prepare_energon_dataset, write_sample_dataset
from .skips import SkipLedger, SkippedSampleCounter
from .task_encoder import (
    DynamicResolution, EncodedSample, FixedTiles, MultimodalTaskEncoder, dynamic_num_tokens, fit_patch_grid,
    patchify, tile_num_tokens,
)
from .tokenizer import ByteTokenizer, HFTokenizer, Tokenizer, load_hf_tokenizer

__all__ = [
    "ByteTokenizer", "DynamicResolution", "EncodedSample", "FixedTiles", "HFTokenizer", "LaneLoader",
    "MultimodalTaskEncoder", "SkipLedger", "SkippedSampleCounter", "Tokenizer", "dynamic_num_tokens",
    "fit_patch_grid", "get_multimodal_train_loader", "load_hf_tokenizer", "make_worker_config",
    "merge_encoder_inputs", "merge_lane_batches", "merge_modality_inputs", "merge_packed_seq_params", "patchify",
    "prepare_energon_dataset", "tile_num_tokens", "write_sample_dataset",
]
