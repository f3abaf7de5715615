"""Tiny random checkpoints of every supported family, built offline from transformers config
classes and saved through ``save_pretrained`` (per-expert layout) or as fused tensors.

Used by the tests and benchmarks; no downloads. Each checkpoint ships a small byte-level BPE
tokenizer trained with the ``tokenizers`` library and a ChatML chat template.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from hearth.engine.config import DTYPES

CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]

# A ChatML template with tools, tool calls and thinking in the Qwen/Hermes style: tools are listed
# in the system turn, calls are ``<tool_call>{json}</tool_call>``, results come back as
# ``<tool_response>`` blocks in a user turn, and reasoning sits in ``<think>...</think>``.
AGENT_TEMPLATE = (
    "{%- macro text(content) -%}{{ content if content is string else '' }}{%- endmacro -%}"
    "{%- if tools or messages[0]['role'] == 'system' -%}"
    "{{ '<|im_start|>system\n' }}"
    "{%- if messages[0]['role'] == 'system' -%}{{ text(messages[0]['content']) }}{%- endif -%}"
    "{%- if tools -%}"
    "{{ '\n\n# Tools\n\nYou may call functions. Their signatures are inside <tools></tools>:\n<tools>' }}"
    "{%- for tool in tools -%}{{ '\n' + (tool | tojson) }}{%- endfor -%}"
    "{{ '\n</tools>\n\nTo call one, reply with a JSON object inside tags:\n"
    "<tool_call>\n{\"name\": <function-name>, \"arguments\": <args-json-object>}\n</tool_call>' }}"
    "{%- endif -%}"
    "{{ '<|im_end|>\n' }}"
    "{%- endif -%}"
    "{%- for message in messages -%}"
    "{%- if message['role'] == 'user' -%}"
    "{{ '<|im_start|>user\n' + text(message['content']) + '<|im_end|>\n' }}"
    "{%- elif message['role'] == 'assistant' -%}"
    "{{ '<|im_start|>assistant\n' }}"
    "{%- if message.get('reasoning_content') -%}"
    "{{ '<think>\n' + message['reasoning_content'] + '\n</think>\n\n' }}"
    "{%- endif -%}"
    "{{ text(message['content']) }}"
    "{%- for call in message.get('tool_calls') or [] -%}"
    "{%- set fn = call['function'] if call.get('function') else call -%}"
    "{{ '\n<tool_call>\n{\"name\": \"' + fn['name'] + '\", \"arguments\": ' }}"
    "{{ fn['arguments'] if fn['arguments'] is string else (fn['arguments'] | tojson) }}"
    "{{ '}\n</tool_call>' }}"
    "{%- endfor -%}"
    "{{ '<|im_end|>\n' }}"
    "{%- elif message['role'] == 'tool' -%}"
    "{%- if loop.first or messages[loop.index0 - 1]['role'] != 'tool' -%}{{ '<|im_start|>user' }}{%- endif -%}"
    "{{ '\n<tool_response>\n' + text(message['content']) + '\n</tool_response>' }}"
    "{%- if loop.last or messages[loop.index0 + 1]['role'] != 'tool' -%}{{ '<|im_end|>\n' }}{%- endif -%}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}"
    "{{ '<|im_start|>assistant\n' }}"
    "{%- if enable_thinking is defined and not enable_thinking -%}{{ '<think>\n\n</think>\n\n' }}{%- endif -%}"
    "{%- endif -%}"
)
# Plain-text markers the agent template uses, added to its tokenizer as single (non-special) tokens.
AGENT_TOKENS = ["<think>", "</think>", "<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"]
# GPT-OSS's harmony markers (special tokens), and a small template in its shape: each turn is
# <|start|>ROLE<|message|>TEXT<|end|>, the tools are listed in a developer turn, and the reply opens
# with <|start|>assistant; <|return|> ends a reply, <|call|> a tool call.
HARMONY_TOKENS = ["<|start|>", "<|end|>", "<|message|>", "<|channel|>", "<|constrain|>", "<|return|>", "<|call|>"]
# DeepSeek's conversation markers (fullwidth bars) as special tokens; its checkpoints ship no template.
DEEPSEEK_TOKENS = ["<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "<｜User｜>", "<｜Assistant｜>"]
# GLM's markers (special tokens), which llama.cpp's converter looks up by name in a GLM tokenizer.
GLM_TOKENS = ["[gMASK]", "<sop>", "<|system|>", "<|user|>", "<|assistant|>", "<|observation|>"]
HARMONY_TEMPLATE = (
    "{%- if tools %}<|start|>developer<|message|># Tools{% for t in tools %} functions.{{ t.function.name }}"
    "{% endfor %}<|end|>{% endif %}"
    "{%- for m in messages %}<|start|>{{ m.role }}{% if m.role == 'assistant' %}<|channel|>final{% endif %}"
    "<|message|>{{ m.content }}<|end|>{% endfor %}"
    "{%- if add_generation_prompt %}<|start|>assistant{% endif %}"
)

_CORPUS = """
def fibonacci(n):
    \"\"\"Return the n-th Fibonacci number.\"\"\"
    a, b = 0, 1
    for _ in range(n):
        a, b = b, a + b
    return a

class Stack:
    def __init__(self):
        self.items = []

    def push(self, item):
        self.items.append(item)

    def pop(self):
        return self.items.pop()

The quick brown fox jumps over the lazy dog. Experts live in host memory and the GPU keeps a
cache of the most recently used ones. Mixture-of-experts models route every token to a few
experts; the router picks them with a softmax over all experts and keeps the top k.
Héllo wörld — naïve café, 東京, Привет, ελληνικά, emoji 🙂🚀 and more unicode text.
import os, sys, json
for line in open("data.txt"):
    print(line.strip().split(","))
"""

FAMILY_DEFAULTS: dict[str, dict[str, Any]] = {
    "qwen3_moe": dict(
        num_experts=8, moe_intermediate_size=32, norm_topk_prob=True, head_dim=16, intermediate_size=96
    ),
    "qwen2_moe": dict(
        num_experts=8, moe_intermediate_size=32, shared_expert_intermediate_size=48, intermediate_size=96
    ),
    "mixtral": dict(num_local_experts=8, intermediate_size=32),
    "olmoe": dict(num_experts=8, intermediate_size=32, norm_topk_prob=False),
    # ERNIE-4.5: interleaved rotary, layer 0 dense, a softmax gate with a correction bias, a shared expert.
    "ernie4_5_moe": dict(moe_num_experts=8, moe_k=2, moe_intermediate_size=32, intermediate_size=96,
                         moe_num_shared_experts=1, moe_layer_start_index=1, head_dim=16),
    # EXAONE-MoE: Qwen3 attention, layers 0-1 in a window and layer 2 global without rotary, layer 0
    # dense, DeepSeek-V3 routing over 2 groups of 4 experts with a shared expert.
    "exaone_moe": dict(num_experts=8, moe_intermediate_size=32, intermediate_size=96, num_shared_experts=1,
                       n_group=2, topk_group=1, routed_scaling_factor=2.5, head_dim=16, sliding_window=6,
                       layer_types=["sliding_attention", "sliding_attention", "full_attention"],
                       mlp_layer_types=["dense", "sparse", "sparse"]),
    # LFM2-MoE: convolution layers 0 and 2 around attention layer 1, layer 0 dense, sigmoid routing
    # with an expert bias (3 layers: the third a convolution).
    "lfm2_moe": dict(num_experts=8, moe_intermediate_size=32, intermediate_size=96, num_dense_layers=1,
                     layer_types=["conv", "full_attention", "conv"], routed_scaling_factor=1.5),
    # Granite 4: Mamba-2 layers 0 and 2 (4 heads of 32 channels, B and C in 2 groups of 16) around attention
    # layer 1 without rotary; Granite's scalars, 8 experts beside the shared MLP.
    "granitemoehybrid": dict(num_local_experts=8, intermediate_size=32, shared_intermediate_size=48,
                             embedding_multiplier=12.0, residual_multiplier=0.22, attention_multiplier=0.2,
                             logits_scaling=6.0, mamba_n_heads=4, mamba_d_head=32, mamba_n_groups=2, mamba_d_state=16,
                             mamba_d_conv=4, mamba_expand=2, mamba_chunk_size=8,
                             layer_types=["linear_attention", "attention", "linear_attention"]),
    # AfMoE: gated attention, layers 0-1 in a window and layer 2 global without rotary, sandwich norms,
    # layer 0 dense, sigmoid routing with an expert bias and a scale, a shared expert, muP embeddings.
    "afmoe": dict(num_experts=8, moe_intermediate_size=32, intermediate_size=96, num_dense_layers=1,
                  num_shared_experts=1, route_scale=2.0, head_dim=16, sliding_window=6, global_attn_every_n_layers=3,
                  mup_enabled=True),
    # FlexOlmo: OLMo-2's post-norms and whole-projection q/k norms, OLMoE's router.
    "flex_olmo": dict(num_experts=8, intermediate_size=32, norm_topk_prob=False, pad_token_id=None),
    # Cohere2-MoE: parallel blocks over a LayerNorm, layer 0 dense (rotary, full attention), layers 1-2
    # in a window with rotary and layer 3 global without, top-k-then-softmax routing, one shared
    # expert averaged in, logits scaled.
    "cohere2_moe": dict(num_experts=8, intermediate_size=32, prefix_dense_intermediate_size=96, num_hidden_layers=4,
                        num_shared_experts=1, first_k_dense_replace=1, sliding_window=6, sliding_window_pattern=3,
                        logit_scale=0.25, head_dim=16, pad_token_id=None, bos_token_id=None),
    # Phi-3.5-MoE: Mixtral's layout with biased LayerNorms, attention and output head; SparseMixer routing.
    "phimoe": dict(num_local_experts=8, intermediate_size=32, attention_bias=True, lm_head_bias=True),
    # HunYuan-MoE: q/k norms after the rotary, an fp32 softmax gate, a shared MLP in every layer, NTK alpha.
    "hunyuan_v1_moe": dict(num_experts=8, moe_topk=2, intermediate_size=32, head_dim=16,
                           rope_parameters={"rope_type": "dynamic", "rope_theta": 10000.0, "alpha": 1000.0,
                                            "factor": 1.0}),
    # Granite MoE with sliding windows on layers 1-2, sinks per head, layer 2 without rotary.
    "granitemoe_swa": dict(num_local_experts=8, intermediate_size=32, embedding_multiplier=12.0,
                           residual_multiplier=0.22, attention_multiplier=0.2, logits_scaling=6.0, sliding_window=6,
                           layer_types=["full_attention", "sliding_attention", "sliding_attention"],
                           layer_rope_theta=[10000.0, 10000.0, 0]),
    # Llama 4: layers 0-2 turn (interleaved pairs) and attend in chunks of 6, layer 3 has no rotary and
    # scales its queries by position; layers 1 and 3 MoE (sigmoid top-1, inputs scaled, a shared expert).
    "llama4": dict(num_local_experts=8, num_experts_per_tok=1, intermediate_size=32, intermediate_size_mlp=96,
                   num_hidden_layers=4, interleave_moe_layer_step=2, head_dim=16, attention_chunk_size=6,
                   floor_scale=4, attn_scale=0.5, pad_token_id=None),
    # JetMoE: attention experts (a query and an output projection each, 2 KV heads of 16) and SwiGLU
    # experts, both top-2 of 8 with biases.
    "jetmoe": dict(num_local_experts=8, intermediate_size=32, kv_channels=16, pad_token_id=None),
    # Mixtral's layout with Granite's four scalars (the embeddings, each residual branch, the
    # attention scores and the logits); the shared form adds an ungated shared expert.
    "granitemoe": dict(num_local_experts=8, intermediate_size=32, embedding_multiplier=12.0, residual_multiplier=0.22,
                       attention_multiplier=0.2, logits_scaling=6.0),
    "granitemoe_shared": dict(num_local_experts=8, intermediate_size=32, shared_intermediate_size=48,
                              embedding_multiplier=12.0, residual_multiplier=0.22, attention_multiplier=0.2,
                              logits_scaling=6.0),
    # Qwen3 attention, DeepSeek-V3 routing: layer 0 dense, 2 groups of 4 experts, a shared expert;
    # the last layer attends within a window.
    "dots1": dict(n_routed_experts=8, moe_intermediate_size=32, intermediate_size=96, n_shared_experts=1,
                  first_k_dense_replace=1, n_group=2, topk_group=1, routed_scaling_factor=2.5, head_dim=16,
                  norm_topk_prob=True, sliding_window=6, max_window_layers=2),
    # GLM-4.7-Flash: DeepSeek-V3's latent attention, GLM's routing; layer 0 dense (mlp_layer_types).
    "glm4_moe_lite": dict(n_routed_experts=8, moe_intermediate_size=32, intermediate_size=96, n_shared_experts=1,
                          n_group=2, topk_group=1, routed_scaling_factor=2.5, q_lora_rank=32, kv_lora_rank=16,
                          qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, num_key_value_heads=4,
                          mlp_layer_types=["dense", "sparse", "sparse"]),
    # Layer 0 dense; sigmoid routing over 2 groups of 4 experts with a correction bias; partial rotary.
    "glm4_moe": dict(n_routed_experts=8, moe_intermediate_size=32, intermediate_size=96, n_shared_experts=1,
                     first_k_dense_replace=1, n_group=2, topk_group=1, routed_scaling_factor=2.5, head_dim=16,
                     use_qk_norm=True, attention_bias=True, partial_rotary_factor=0.5),
    # DeepSeek-V3's shape with sparse attention: each query keeps the indexer's best 6 tokens, so
    # every prompt past 6 tokens takes the sparse path (16 index heads: a token scores exactly 0, all
    # heads negative, once in 65536, so exact ties that either side may break its own way stay rare).
    "deepseek_v32": dict(n_routed_experts=8, moe_intermediate_size=32, intermediate_size=96, n_shared_experts=1,
                         first_k_dense_replace=1, n_group=2, topk_group=1, routed_scaling_factor=2.5,
                         q_lora_rank=32, kv_lora_rank=16, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16,
                         num_key_value_heads=4, index_topk=6, index_head_dim=16, index_n_heads=16),
    # GLM-5: the same with the indexer's rotary on pairs, and layer 1 reusing layer 0's selection.
    "glm_moe_dsa": dict(n_routed_experts=8, moe_intermediate_size=32, intermediate_size=96, n_shared_experts=1,
                        first_k_dense_replace=1, n_group=1, topk_group=1, routed_scaling_factor=2.5,
                        q_lora_rank=32, kv_lora_rank=16, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16,
                        num_key_value_heads=4, index_topk=6, index_head_dim=16, index_n_heads=16,
                        indexer_types=["full", "shared", "full"]),
    # Kimi-Linear: delta attention (per-channel decays) around one NoPE latent attention layer;
    # layer 0 dense; DeepSeek-V3's routing over 2 groups of 4 experts.
    "kimi_linear": dict(num_local_experts=8, moe_intermediate_size=32, intermediate_size=96, n_shared_experts=1,
                        n_group=2, topk_group=1, routed_scaling_factor=2.5, kv_lora_rank=16, qk_nope_head_dim=16,
                        qk_rope_head_dim=8, v_head_dim=16, num_key_value_heads=4, linear_head_dim=16,
                        linear_num_heads=4, pad_token_id=None, bos_token_id=None,
                        layer_types=["linear_attention", "full_attention", "linear_attention"],
                        mlp_layer_types=["dense", "sparse", "sparse"]),
    # Ling 3.0: Kimi-Linear's layout with head-gated, rotary latent attention every second layer and
    # Ling's bounded decays. (The linear heads' width equals the rotary width: transformers reads its own
    # saved config's head_dim, which it overwrote with the rotary width, as the linear heads' width.)
    "bailing_hybrid": dict(num_local_experts=8, moe_intermediate_size=32, intermediate_size=96, n_shared_experts=1,
                           n_group=2, topk_group=1, routed_scaling_factor=2.5, kv_lora_rank=16, qk_nope_head_dim=16,
                           qk_rope_head_dim=16, v_head_dim=16, head_dim=16, num_key_value_heads=4,
                           first_k_dense_replace=1, layer_group_size=2, pad_token_id=None, num_mtp_layers=0),
    # Solar Open: GLM-4.5's network with every layer MoE, q/k/v biases and no q/k norms.
    "solar_open": dict(n_routed_experts=8, moe_intermediate_size=32, n_shared_experts=1, n_group=2, topk_group=1,
                       routed_scaling_factor=2.5, head_dim=16, attention_bias=True),
    # MLA with a low-rank query; layer 0 dense; 2 groups of 4 experts, one group chosen.
    "deepseek_v3": dict(n_routed_experts=8, moe_intermediate_size=32, intermediate_size=96, n_shared_experts=1,
                        first_k_dense_replace=1, n_group=2, topk_group=1, routed_scaling_factor=2.5, q_lora_rank=32,
                        kv_lora_rank=16, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16,
                        num_key_value_heads=4),
    # DeepSeek-V2 (Lite-like: no query LoRA), softmax routing limited to the best of 2 groups.
    "deepseek_v2": dict(n_routed_experts=8, moe_intermediate_size=32, intermediate_size=96, n_shared_experts=2,
                        first_k_dense_replace=1, n_group=2, topk_group=1, topk_method="group_limited_greedy",
                        routed_scaling_factor=1.5, q_lora_rank=None, kv_lora_rank=16, qk_nope_head_dim=16,
                        qk_rope_head_dim=8, v_head_dim=16, num_key_value_heads=4),
    "minimax_m2": dict(num_local_experts=8, intermediate_size=32, head_dim=16, rotary_dim=8),
    # Layers alternate sliding (window 8) and full attention; a small swiglu_limit so the clamps act.
    "gpt_oss": dict(num_local_experts=8, intermediate_size=32, head_dim=16, sliding_window=8, swiglu_limit=0.5,
                    rope_parameters={"rope_type": "yarn", "factor": 4.0, "beta_fast": 32.0, "beta_slow": 1.0,
                                     "truncate": False, "original_max_position_embeddings": 1024,
                                     "rope_theta": 150000.0}),
    # Four layers: sliding, CSA (entries every 4 tokens, the indexer keeping 3), HCA (every 8), CSA;
    # the first MoE layer hash-routed; 4 hyper-connection streams; YaRN on the compressed layers.
    "deepseek_v4": dict(
        num_hidden_layers=4, num_key_value_heads=1, head_dim=32, q_lora_rank=32, o_groups=2, o_lora_rank=16,
        index_n_heads=8, index_head_dim=16, index_topk=3, sliding_window=8,
        compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 8},
        layer_types=["sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention",
                     "compressed_sparse_attention"],
        mlp_layer_types=["hash_moe", "moe", "moe", "moe"], n_routed_experts=8, moe_intermediate_size=32,
        hc_mult=4, partial_rotary_factor=0.25, swiglu_limit=0.5,
        rope_parameters={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 1024,
                         "beta_fast": 32.0, "beta_slow": 1.0},
    ),
    # Hybrids: layers 0-2 gated DeltaNet, layer 3 gated attention (transformers' default 3:1 pattern).
    "qwen3_next": dict(
        num_hidden_layers=4, num_experts=8, moe_intermediate_size=32, shared_expert_intermediate_size=48,
        intermediate_size=96, head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4,
        linear_key_head_dim=16, linear_value_head_dim=16, linear_conv_kernel_dim=4,
    ),
    "qwen3_5_moe": dict(
        num_hidden_layers=4, num_experts=8, moe_intermediate_size=32, shared_expert_intermediate_size=48,
        head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
        linear_value_head_dim=16, linear_conv_kernel_dim=4,
    ),
}
HYBRID_FAMILIES = ("qwen3_next", "qwen3_5_moe", "kimi_linear", "bailing_hybrid")


def build_tokenizer(out_dir: Path, vocab_size: int = 384, chat_format: str = "chatml") -> Any:
    """Train a byte-level BPE tokenizer on a small built-in corpus and save it to ``out_dir``.

    ``chat_format`` is ``chatml`` (plain ChatML), ``agent`` (ChatML with tools and thinking, and
    their markers as single tokens), ``harmony`` (GPT-OSS's markers as special tokens) or
    ``deepseek_v4`` (DeepSeek's markers as special tokens, think tags, and no chat template, as
    DeepSeek-V4 ships) or ``glm`` (ChatML with GLM's markers as special tokens besides)."""
    if chat_format not in ("chatml", "agent", "harmony", "deepseek_v4", "glm"):
        raise ValueError(f"unknown chat format '{chat_format}' (chatml, agent, harmony, deepseek_v4 or glm)")
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator([_CORPUS] * 4, trainer=trainer)
    if chat_format == "agent":
        tok.add_tokens(AGENT_TOKENS)
    if chat_format == "harmony":
        tok.add_special_tokens(HARMONY_TOKENS)
    if chat_format == "deepseek_v4":
        tok.add_special_tokens(DEEPSEEK_TOKENS)
        tok.add_tokens(["<think>", "</think>"])
    if chat_format == "glm":
        tok.add_special_tokens(GLM_TOKENS)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token={"harmony": "<|return|>", "deepseek_v4": DEEPSEEK_TOKENS[1]}.get(chat_format, "<|im_end|>"),
        pad_token="<|endoftext|>",
        bos_token=DEEPSEEK_TOKENS[0] if chat_format == "deepseek_v4" else None,
    )
    if chat_format != "deepseek_v4":
        fast.chat_template = {"agent": AGENT_TEMPLATE, "harmony": HARMONY_TEMPLATE}.get(chat_format,
                                                                                          CHATML_TEMPLATE)
    fast.save_pretrained(str(out_dir))
    return fast


def write_gpt2_files(out_dir: Path) -> None:
    """The checkpoint's byte-level BPE tokenizer as GPT-2's ``vocab.json`` + ``merges.txt`` (same ids),
    adding ``<|endoftext|>`` as BOS, in place of ``tokenizer.json``."""
    out = Path(out_dir)
    model = json.loads((out / "tokenizer.json").read_text())["model"]
    (out / "vocab.json").write_text(json.dumps(model["vocab"]))
    merges = [" ".join(m) if isinstance(m, list) else m for m in model["merges"]]
    (out / "merges.txt").write_text("\n".join(["#version: 0.2", *merges]) + "\n")
    config = json.loads((out / "tokenizer_config.json").read_text())
    config.update(tokenizer_class="GPT2Tokenizer", add_bos_token=True, bos_token="<|endoftext|>")
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2))
    (out / "tokenizer.json").unlink()


def write_sentencepiece(out_dir: Path, vocab_size: int = 300) -> Path:
    """A SentencePiece BPE model trained on the built-in corpus, saved as ``tokenizer.model`` (ids 0-2:
    unk, bos, eos): what a checkpoint shipping a SentencePiece tokenizer holds."""
    import io

    import sentencepiece as spm  # deferred: needed only for the checkpoints that ship one

    model = io.BytesIO()
    spm.SentencePieceTrainer.train(sentence_iterator=iter(_CORPUS.splitlines() * 4), model_writer=model,
                                   vocab_size=vocab_size, model_type="bpe", hard_vocab_limit=False, minloglevel=2,
                                   unk_id=0, bos_id=1, eos_id=2, pad_id=-1)
    path = Path(out_dir) / "tokenizer.model"
    path.write_bytes(model.getvalue())
    return path


def _config(family: str, vocab_size: int, eos_id: int, **overrides: Any):
    from transformers import (
        AfmoeConfig,
        BailingHybridConfig,
        Cohere2MoeConfig,
        DeepseekV2Config,
        DeepseekV3Config,
        DeepseekV4Config,
        DeepseekV32Config,
        Dots1Config,
        Ernie4_5_MoeConfig,
        ExaoneMoeConfig,
        FlexOlmoConfig,
        Glm4MoeConfig,
        Glm4MoeLiteConfig,
        GlmMoeDsaConfig,
        GptOssConfig,
        GraniteMoeConfig,
        GraniteMoeHybridConfig,
        GraniteMoeSharedConfig,
        GraniteMoeSWAConfig,
        HunYuanMoEV1Config,
        JetMoeConfig,
        KimiLinearConfig,
        Lfm2MoeConfig,
        Llama4TextConfig,
        MiniMaxM2Config,
        MixtralConfig,
        OlmoeConfig,
        PhimoeConfig,
        Qwen2MoeConfig,
        Qwen3_5MoeTextConfig,
        Qwen3MoeConfig,
        Qwen3NextConfig,
        SolarOpenConfig,
    )

    classes = {"qwen3_moe": Qwen3MoeConfig, "qwen2_moe": Qwen2MoeConfig, "mixtral": MixtralConfig,
               "qwen3_next": Qwen3NextConfig, "qwen3_5_moe": Qwen3_5MoeTextConfig, "olmoe": OlmoeConfig,
               "glm4_moe": Glm4MoeConfig, "deepseek_v3": DeepseekV3Config,
               "deepseek_v2": DeepseekV2Config, "minimax_m2": MiniMaxM2Config,
               "gpt_oss": GptOssConfig, "deepseek_v4": DeepseekV4Config, "dots1": Dots1Config,
               "glm4_moe_lite": Glm4MoeLiteConfig, "granitemoe": GraniteMoeConfig,
               "granitemoe_shared": GraniteMoeSharedConfig, "ernie4_5_moe": Ernie4_5_MoeConfig,
               "exaone_moe": ExaoneMoeConfig, "lfm2_moe": Lfm2MoeConfig,
               "granitemoehybrid": GraniteMoeHybridConfig, "afmoe": AfmoeConfig,
               "flex_olmo": FlexOlmoConfig, "cohere2_moe": Cohere2MoeConfig,
               "phimoe": PhimoeConfig, "hunyuan_v1_moe": HunYuanMoEV1Config,
               "granitemoe_swa": GraniteMoeSWAConfig, "llama4": Llama4TextConfig,
               "jetmoe": JetMoeConfig, "deepseek_v32": DeepseekV32Config, "glm_moe_dsa": GlmMoeDsaConfig,
               "kimi_linear": KimiLinearConfig, "bailing_hybrid": BailingHybridConfig,
               "solar_open": SolarOpenConfig}
    if family not in classes:
        raise ValueError(f"unknown family '{family}' (one of {', '.join(classes)})")
    kwargs: dict[str, Any] = dict(
        vocab_size=vocab_size,
        hidden_size=64,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_experts_per_tok=2,
        max_position_embeddings=4096,
        initializer_range=0.08,
        eos_token_id=eos_id,
        tie_word_embeddings=False,
    )
    kwargs.update(FAMILY_DEFAULTS[family])
    kwargs.update(overrides)
    return classes[family](**kwargs)


def build_hf_model(family: str, vocab_size: int = 384, eos_id: int = 2, seed: int = 0, **overrides: Any):
    """A randomly initialised transformers model of ``family`` (fp32, eval mode)."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    cfg = _config(family, vocab_size, eos_id, **overrides)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    with torch.no_grad():  # transformers initialises biases to zero, which would test nothing
        for name, param in model.named_parameters():
            if name.endswith((".bias", "_bias")):  # (GPT-OSS's experts: gate_up_proj_bias, down_proj_bias)
                param.normal_(0.0, 0.05)
            if name.endswith(".sinks"):  # GPT-OSS's attention sinks: zero would still be a sink; vary them
                param.normal_(0.0, 1.0)
            if name.endswith((".position_bias", ".base", ".hc_base")):  # DeepSeek-V4's, zero at init
                param.normal_(0.0, 0.5)
        for name, buffer in model.named_buffers():
            if name.endswith(("e_score_correction_bias", ".expert_bias")):  # enough to change the choice of experts
                buffer.normal_(0.0, 0.3)
            if name.endswith("tid2eid"):  # DeepSeek-V4's hash routing: k distinct experts per token
                buffer.copy_(torch.rand(buffer.shape[0], cfg.n_routed_experts).argsort(dim=-1)[:, : buffer.shape[1]])
    return model.eval()


def save_fused(model: Any, out_dir: Path, shard_bytes: int) -> None:
    """Save the in-memory (fused-expert) state dict as sharded safetensors plus an index."""
    model.config.architectures = [type(model).__name__]
    model.config.save_pretrained(str(out_dir))
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    if model.config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, tensor in state.items():
        if shards[-1] and size + tensor.nbytes > shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = tensor
        size += tensor.nbytes
    weight_map, total = {}, 0
    for i, shard in enumerate(shards):
        fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, str(out_dir / fname), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(shard, fname))
        total += sum(t.nbytes for t in shard.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (out_dir / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))


def make_checkpoint(
    out_dir: str | Path,
    family: str = "qwen3_moe",
    layout: str = "per_expert",
    dtype: str = "float32",
    seed: int = 0,
    shard_bytes: int = 200_000,
    vocab_size: int | None = None,
    chat_format: str = "chatml",
    **overrides: Any,
) -> tuple[Path, Any]:
    """Write a tiny random checkpoint (config, safetensors, tokenizer) to ``out_dir``.

    Returns the directory and the transformers model it was saved from (in ``dtype``), which
    tests use as the reference. ``layout`` is ``per_expert`` (transformers' ``save_pretrained``)
    or ``fused`` (``experts.gate_up_proj`` / ``experts.down_proj`` tensors). ``vocab_size`` may
    exceed the tokenizer's (the extra rows are never produced by it), for realistic head sizes.
    ``chat_format`` chooses the chat template (see :func:`build_tokenizer`).
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tok = build_tokenizer(out, chat_format=chat_format)
    vocab = max(vocab_size or 0, len(tok))
    model = build_hf_model(family, vocab_size=vocab, eos_id=tok.eos_token_id, seed=seed, **overrides)
    model = model.to(DTYPES[dtype])
    if layout == "per_expert":
        model.save_pretrained(str(out), max_shard_size=shard_bytes)
    elif layout == "fused":
        save_fused(model, out, shard_bytes)
    else:
        raise ValueError(f"unknown layout '{layout}' (per_expert or fused)")
    model.generation_config.save_pretrained(str(out))
    return out, model


def record_logits(llm: Any) -> dict[str, list[torch.Tensor]]:
    """Wrap ``llm``'s runner so every sampled row's logits are kept, per request id (for
    comparing two engines step by step)."""
    recorded: dict[str, list[torch.Tensor]] = {}
    execute = llm.engine.runner.execute

    def wrapped(items, *args, **kwargs):
        logits, sampled = execute(items, *args, **kwargs)
        for row, req in enumerate(sampled):
            recorded.setdefault(req.request_id, []).append(logits[row].clone())
        return logits, sampled

    llm.engine.runner.execute = wrapped
    return recorded


def main(argv: list[str] | None = None) -> None:
    """``python -m tests.checkpoints DIR [--family F] [--layout L] [--dtype D]``: write a tiny checkpoint."""
    import argparse

    ap = argparse.ArgumentParser(prog="python -m tests.checkpoints", description=main.__doc__)
    ap.add_argument("out_dir")
    ap.add_argument("--family", default="qwen3_moe", choices=sorted(FAMILY_DEFAULTS))
    ap.add_argument("--layout", default="per_expert", choices=["per_expert", "fused"])
    ap.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16", "float16"])
    args = ap.parse_args(argv)
    path, _ = make_checkpoint(args.out_dir, args.family, args.layout, args.dtype)
    print(path)


if __name__ == "__main__":
    main()
