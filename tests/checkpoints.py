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
from tests.family_configs import CONFIG_CLASSES, FAMILY_DEFAULTS

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
# Solar Open's markers (special tokens), which llama.cpp's converter looks up by name.
SOLAR_TOKENS = ["<unk>", "<|startoftext|>"]
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

HYBRID_FAMILIES = ("qwen3_next", "qwen3_5_moe", "kimi_linear", "bailing_hybrid")


def build_tokenizer(out_dir: Path, vocab_size: int = 384, chat_format: str = "chatml") -> Any:
    """Train a byte-level BPE tokenizer on a small built-in corpus and save it to ``out_dir``.

    ``chat_format`` is ``chatml`` (plain ChatML), ``agent`` (ChatML with tools and thinking, and
    their markers as single tokens), ``harmony`` (GPT-OSS's markers as special tokens) or
    ``deepseek_v4`` (DeepSeek's markers as special tokens, think tags, and no chat template, as
    DeepSeek-V4 ships) or ``glm`` (ChatML with GLM's markers as special tokens besides) or ``solar``
    (ChatML with Solar Open's unknown and start-of-text tokens besides)."""
    if chat_format not in ("chatml", "agent", "harmony", "deepseek_v4", "glm", "solar"):
        raise ValueError(f"unknown chat format '{chat_format}' (chatml, agent, harmony, deepseek_v4, glm or solar)")
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
    if chat_format == "solar":
        tok.add_special_tokens(SOLAR_TOKENS)
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
    import transformers

    if family not in CONFIG_CLASSES:
        raise ValueError(f"unknown family '{family}' (one of {', '.join(CONFIG_CLASSES)})")
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
    return getattr(transformers, CONFIG_CLASSES[family])(**kwargs)


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
