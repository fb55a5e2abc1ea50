"""Data for multimodal training through megatron-energon: a synthetic sample dataset, tokenizers, the task encoders
(captioning samples; every accepted sample type as a conversation through a chat template, hand-written or a
tokenizer folder's own, with the cooker for crude chat datasets), lane merging of encoder inputs, skip accounting,
and the lane loader that feeds a rank's lanes (resumable, routed by energon's global worker id)."""

from .chat_cooker import CHAT_COOKER, ChatSample, cook_chat
from .chat_template import CHAT_TEMPLATES, NEMOTRON, PLAIN, ChatTemplate, chat_template
from .conversation import Conversation, Turn
from .conversation_encoder import ConversationTaskEncoder
from .hf_chat_template import HFChatTemplate, ImageMarkers, load_hf_chat_template, select_chat_template
from .lane_loader import LaneLoader
from .lanes import merge_encoder_inputs, merge_lane_batches, merge_modality_inputs, merge_packed_seq_params
from .loader import get_multimodal_train_loader, make_worker_config
from .sample_dataset import prepare_energon_dataset, write_sample_dataset
from .sample_formats import readable_type_names
from .counts import DataCounts
from .skips import SkippedSampleCounter, SkipRecord
from .images import DynamicResolution, FixedTiles, dynamic_num_tokens, fit_patch_grid, patchify, tile_num_tokens
from .task_encoder import EncodedSample, MultimodalTaskEncoder
from .tokenizer import ByteTokenizer, HFTokenizer, Tokenizer, load_hf_tokenizer
from .video_clips import clip_tokens, clip_tubelets, collate_clips, concat_clips, sequence_grids

__all__ = [
    "CHAT_COOKER", "CHAT_TEMPLATES", "NEMOTRON", "PLAIN", "ByteTokenizer", "ChatSample", "ChatTemplate",
    "Conversation", "ConversationTaskEncoder", "DataCounts", "DynamicResolution", "EncodedSample", "FixedTiles", "HFChatTemplate", "HFTokenizer", "ImageMarkers",
    "LaneLoader", "MultimodalTaskEncoder", "SkipRecord", "SkippedSampleCounter", "Tokenizer", "Turn",
    "chat_template", "clip_tokens", "clip_tubelets", "collate_clips", "concat_clips", "cook_chat",
    "dynamic_num_tokens", "fit_patch_grid", "get_multimodal_train_loader",
    "load_hf_chat_template", "load_hf_tokenizer", "make_worker_config", "merge_encoder_inputs", "merge_lane_batches", "merge_modality_inputs",
    "merge_packed_seq_params", "patchify", "prepare_energon_dataset", "readable_type_names", "select_chat_template",
    "sequence_grids", "tile_num_tokens", "write_sample_dataset",
]
