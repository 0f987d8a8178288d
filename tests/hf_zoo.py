"""Tiny random Hugging Face causal LMs, built from configs (no downloads), for every
architecture a test sweeps: `build_type(model_type)` -> a seeded fp32 model in eval mode.

One table of small widths is applied to whatever fields a config class has (`SMALL`), then a
few per-architecture fields (`EXTRA`); sliding windows, attention chunks and convolution kernels
are shorter than the sweep's prompts plus new tokens, so a test reaches past them.
"""
from __future__ import annotations

import dataclasses

import torch

VOCAB = 128
WINDOW = 4

SMALL = dict(   # field -> tiny value, set where the config class has the field
    vocab_size=VOCAB, hidden_size=64, n_embd=64, d_model=64, intermediate_size=128, n_inner=128, ffn_dim=128,
    num_hidden_layers=2, n_layer=2, num_layers=2, num_attention_heads=4, n_head=4, num_key_value_heads=2,
    head_dim=16, max_position_embeddings=128, n_positions=128, sliding_window=WINDOW,
    num_experts=4, num_local_experts=4, n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
    shared_expert_intermediate_size=32, n_shared_experts=1, n_group=1, topk_group=1,
    first_k_dense_replace=1, kv_lora_rank=16, q_lora_rank=24, qk_rope_head_dim=8, qk_nope_head_dim=16,
    v_head_dim=16, attention_chunk_size=WINDOW, conv_L_cache=3, mamba_d_state=8, mamba_n_heads=4,
    mamba_d_head=16, mamba_n_groups=1, linear_num_key_heads=2, linear_num_value_heads=4,
    linear_key_head_dim=16, linear_value_head_dim=16, bos_token_id=None, eos_token_id=None, pad_token_id=0,
    initializer_range=0.1, use_mamba_kernels=False, tie_word_embeddings=False, rotary_dim=8,
)

EXTRA = {   # model_type -> fields beyond SMALL
    "gpt_oss": dict(layer_types=["sliding_attention", "full_attention"]),
    "granite_swa": dict(layer_types=["sliding_attention", "full_attention"]),
    "granitemoe_swa": dict(layer_types=["sliding_attention", "full_attention"]),
    "gemma2": dict(layer_types=["sliding_attention", "full_attention"], attn_implementation="eager"),
    "llama4_text": dict(no_rope_layers=[1, 0], interleave_moe_layer_step=1, intermediate_size_mlp=128),
    "lfm2": dict(layer_types=["conv", "full_attention"]),
    "minimax": dict(layer_types=["linear_attention", "full_attention"]),
    "qwen3_next": dict(layer_types=["linear_attention", "full_attention"]),
    "qwen3_5_text": dict(layer_types=["linear_attention", "full_attention"]),
    "qwen3_5_moe_text": dict(layer_types=["linear_attention", "full_attention"]),
    "kimi_linear": dict(layer_types=["linear_attention", "full_attention"], linear_head_dim=16, linear_num_heads=4),
    "bailing_hybrid": dict(layer_group_size=2),        # a linear-attention layer, then a full one
    "lfm2_moe": dict(layer_types=["conv", "full_attention"]),
    "zamba2": dict(layers_block_type=["mamba", "hybrid"]),
    "recurrent_gemma": dict(block_types=["recurrent", "attention"], lru_width=64, attention_window_size=WINDOW),
    "jamba": dict(attn_layer_period=2, attn_layer_offset=1, expert_layer_period=2, expert_layer_offset=1),
    "gpt_neo": dict(attention_types=[[["global", "local"], 1]], window_size=WINDOW),
    "bamba": dict(attn_layer_indices=[1], mamba_n_heads=8),
    "granitemoehybrid": dict(layer_types=["mamba", "attention"], mamba_n_heads=8),
    "falcon_h1": dict(mamba_n_heads=8, mamba_d_ssm=128),
    "mamba2": dict(num_heads=8, state_size=8, n_groups=1),
    "gemma4_text": dict(vocab_size_per_layer_input=VOCAB, hidden_size_per_layer_input=8, global_head_dim=32,
                        layer_types=["sliding_attention", "full_attention"]),
    "deepseek_v2": dict(num_key_value_heads=4),     # MLA: every head has its keys and values
    "deepseek_v3": dict(num_key_value_heads=4),
    "longcat_flash": dict(num_key_value_heads=4, head_dim=8, ffn_hidden_size=128, moe_topk=2, zero_expert_num=2,
                          expert_ffn_hidden_size=32),            # MLA; its rotary is head_dim wide: qk_rope_head_dim
    # rope parameters per layer type; the full-attention layers have no rope
    "cohere_compass_text": dict(layer_types=["sliding_attention", "full_attention"],
                                rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
                                                 "full_attention": None}),
    "dbrx": dict(n_heads=4, n_layers=2, max_seq_len=128, ffn_config=dict(ffn_hidden_size=32, moe_top_k=2),
                 # DbrxAttention reads attn_config.rope_theta, which DbrxAttentionConfig does not declare
                 attn_config=dict(kv_n_heads=2, clip_qkv=8.0, rope_theta=1e4)),
    "dory": dict(num_hidden_layers=3, n_input_layers=1, n_recurrent_layers=1, n_output_layers=1,   # layer 1 runs
                 layer_types=["sliding_attention", "full_attention", "sliding_attention"]),     # twice a forward
    "gemma3n_text": dict(num_hidden_layers=4, layer_types=["sliding_attention", "full_attention"] * 2,
                         num_kv_shared_layers=2,              # layers 2 and 3 read layers 0 and 1's keys and values
                         vocab_size_per_layer_input=VOCAB, hidden_size_per_layer_input=8, laurel_rank=8),
    "inkling2_text": dict(unpadded_vocab_size=VOCAB, swa_num_attention_heads=4, swa_num_key_value_heads=2,
                          swa_head_dim=16, sliding_window_size=WINDOW, d_rel=8, rel_extent=16,
                          layer_types=["hybrid_sliding", "hybrid"], n_layers_per_attn_res_block=1),
    "inkling2_loop_text": dict(num_hidden_layers=3, unpadded_vocab_size=VOCAB, swa_num_attention_heads=4,
                               swa_num_key_value_heads=2, swa_head_dim=16, sliding_window_size=WINDOW, d_rel=8,
                               rel_extent=16, layer_types=["hybrid_sliding", "hybrid", "hybrid_sliding"],
                               n_layers_per_attn_res_block=1, loop_layer_index_start=1, loop_layer_index_end=2,
                               loop_num_passes=2, loop_gate_rank=8),
    "kolibri1_1": dict(num_hidden_layers=4, layer_types=["sliding_attention", "indexed_attention"] * 2,
                       index_layers=[1], kv_source_layers=[0, 1, 2, 1], index_num_heads=1, index_topk=4,
                       index_pool_size=16, index_compression=4, index_num_local_tokens=2, index_num_sink_tokens=1,
                       mlp_only_layers=[0], mlp_only_intermediate_size=128),
    "qwen4_exp_text": dict(layer_types=["linear_attention", "indexed_attention"], hc_lowrank=8, indexer_n_heads=2,
                           indexer_kv_heads=1, indexer_head_dim=16, indexer_budget=4, indexer_compress_ratio=2),
    # xLSTM sizes its q / k projections hidden_size * qk_dim_factor, its state that rounded up to 64
    "xlstm": dict(num_heads=4, qk_dim_factor=1.0),
    "zamba": dict(layers_block_type=["mamba", "hybrid"]),
    "zaya": dict(num_experts_per_tok=1, router_hidden_size=16, layer_types=["hybrid_sliding", "hybrid"]),
}


def fields_of(cfg_cls) -> set[str]:
    """The keyword fields a config class takes."""
    if dataclasses.is_dataclass(cfg_cls):
        return {f.name for f in dataclasses.fields(cfg_cls)}
    import inspect
    return set(inspect.signature(cfg_cls.__init__).parameters)


def takes_none(cfg_cls, name: str) -> bool:
    """Whether the config class's field `name` may be None (a strict dataclass field typed `int`
    may not: its default then stands, a token id outside the tiny vocabulary that is never drawn)."""
    if not dataclasses.is_dataclass(cfg_cls):
        return True
    types = {f.name: f.type for f in dataclasses.fields(cfg_cls)}
    return "None" in str(types.get(name))


def tiny_config(model_type: str, **overrides):
    from transformers import CONFIG_MAPPING
    cfg_cls = CONFIG_MAPPING[model_type]
    names = fields_of(cfg_cls)
    kwargs = {k: v for k, v in SMALL.items() if k in names and (v is not None or takes_none(cfg_cls, k))}
    kwargs.update(EXTRA.get(model_type, {}), **overrides)
    return cfg_cls(**kwargs)


def build_type(model_type: str, seed: int = 0, **overrides):
    """A tiny random model of `model_type`'s causal LM class (fp32, eval); `overrides`: config fields."""
    import transformers
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
    cls = getattr(transformers, MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[model_type])
    cfg = tiny_config(model_type, **overrides)
    torch.manual_seed(seed)
    return cls(cfg).eval()


# decoder-only text causal LMs the sweep covers; encoder-decoder, encoder-as-decoder (BERT-likes)
# and multimodal wrappers are not padgraph.hf's business (their causal-LM heads take other inputs)
NOT_DECODERS = {
    "bart", "bert", "bert-generation", "big_bird", "bigbird_pegasus", "blenderbot", "blenderbot-small", "camembert",
    "data2vec-text", "electra", "ernie", "marian", "mbart", "megatron-bert", "mvp", "pegasus", "plbart", "prophetnet",
    "rembert", "roberta", "roberta-prelayernorm", "roc_bert", "roformer", "trocr", "whisper", "xlm", "xlm-roberta",
    "xlm-roberta-xl", "xmod", "xlnet", "reformer", "git", "moshi", "musicgen", "musicgen_melody", "mllama",
    "blt", "fuyu", "gemma3", "gemma3n", "gemma4", "gemma4_unified", "gemma4_unified_assistant", "gemma4_assistant",
    "got_ocr2", "llama4", "emu3", "dots3_note", "phi4_multimodal", "moss_transcribe_diarize", "cpmant",
    "qwen3_5", "qwen3_5_moe", "qwen4_exp", "minimax_m3_vl_text",
}


def architectures() -> list[str]:
    """Every model type this transformers maps to a causal LM, but `NOT_DECODERS`."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
    return sorted(t for t in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES if t not in NOT_DECODERS)
