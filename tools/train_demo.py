"""Train hearth's bundled demo model: a small Qwen3-MoE that writes Python.

Everything comes from the machine itself, so the recipe runs offline anywhere: the training text is
the Python standard library's own sources (tests excluded) plus this project's docs, and the chat
samples are the library's documented functions, asked for by name and docstring and answered with
their source. A byte-level BPE tokenizer is trained on the same text with the ``tokenizers``
library; the chat template is the agent template the serving tests use (tools, thinking).

The router is trained with the usual auxiliary load-balancing loss so that experts specialise while
the load stays spread. The run is reproducible for a given seed and Python version (the stdlib is
the corpus). Default size: 6 layers, 32 experts, top-4, hidden 256 — about 33 MB in bf16, about
an hour on 2 CPU cores.

    python tools/train_demo.py --out engine/assets/hearth-demo
"""

from __future__ import annotations

import argparse
import ast
import hashlib
import json
import math
import random
import sys
import sysconfig
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.checkpoints import AGENT_TEMPLATE, AGENT_TOKENS, SPECIAL_TOKENS  # noqa: E402

EOT = "<|endoftext|>"
HELD_OUT_PERCENT = 5  # stdlib files whose name hashes below this go to the held-out set


def is_held_out(name: str) -> bool:
    """Deterministic train/held-out split by file name (stable across machines and runs)."""
    return int(hashlib.sha256(name.encode()).hexdigest(), 16) % 100 < HELD_OUT_PERCENT


def stdlib_files() -> list[Path]:
    """The standard library's Python sources, tests and third-party packages excluded, sorted."""
    lib = Path(sysconfig.get_paths()["stdlib"])
    skip = ("site-packages", "test", "tests", "idlelib", "lib2to3", "turtledemo", "__pycache__")
    files = [p for p in lib.rglob("*.py") if not any(part in skip for part in p.relative_to(lib).parts)]
    return sorted(files, key=lambda p: str(p.relative_to(lib)))


def project_docs() -> list[Path]:
    """This project's Markdown docs (README and docs/), so the model has seen its own manual."""
    return sorted([ROOT / "README.md", *(ROOT / "docs").glob("*.md")])


def read_text(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except (UnicodeDecodeError, OSError):
        return ""


def corpus(held_out: bool) -> list[str]:
    """The documents of one split; docs are always in the training split."""
    lib = Path(sysconfig.get_paths()["stdlib"])
    docs = [read_text(p) for p in stdlib_files() if is_held_out(str(p.relative_to(lib))) == held_out]
    if not held_out:
        docs += [read_text(p) for p in project_docs() if p.is_file()]
    return [d for d in docs if d.strip()]


def chat_pairs(sources: list[str], limit: int) -> list[tuple[str, str]]:
    """(request, answer) pairs from documented top-level functions: the request names the function
    and quotes its docstring's first line; the answer is the function's source."""
    pairs = []
    for src in sources:
        try:
            tree = ast.parse(src)
        except SyntaxError:
            continue
        for node in tree.body:
            if not isinstance(node, ast.FunctionDef) or node.name.startswith("_"):
                continue
            doc = ast.get_docstring(node)
            code = ast.get_source_segment(src, node)
            if not doc or not code or len(code) > 1500:
                continue
            args = ", ".join(a.arg for a in node.args.args)
            summary = doc.strip().splitlines()[0]
            pairs.append((f"Write a Python function {node.name}({args}): {summary}", code))
    return pairs[:limit]


def train_tokenizer(texts: list[str], vocab_size: int, out: Path):
    """Byte-level BPE on the training text, with ChatML specials and the agent markers."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size - len(AGENT_TOKENS),
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    tok.add_tokens(AGENT_TOKENS)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token=EOT, bos_token=None)
    fast.chat_template = AGENT_TEMPLATE
    fast.save_pretrained(str(out))
    return fast


def token_stream(tok, docs: list[str], chats: list[tuple[str, str]], seed: int) -> torch.Tensor:
    """All training documents and chat samples, shuffled, as one id stream separated by EOT."""
    texts = list(docs)
    for request, answer in chats:
        messages = [{"role": "user", "content": request}, {"role": "assistant", "content": answer}]
        texts.append(tok.apply_chat_template(messages, tokenize=False))
    random.Random(seed).shuffle(texts)
    eot = tok.convert_tokens_to_ids(EOT)
    ids: list[int] = []
    for text in texts:
        ids.extend(tok.encode(text, add_special_tokens=False))
        ids.append(eot)
    return torch.tensor(ids, dtype=torch.long)


def model_config(args, tok):
    from transformers import Qwen3MoeConfig

    return Qwen3MoeConfig(
        vocab_size=len(tok),
        hidden_size=args.hidden,
        num_hidden_layers=args.layers,
        num_attention_heads=args.hidden // 64,
        num_key_value_heads=max(1, args.hidden // 128),
        head_dim=64,
        num_experts=args.experts,
        num_experts_per_tok=args.top_k,
        moe_intermediate_size=args.expert_size,
        intermediate_size=args.expert_size * args.top_k,
        norm_topk_prob=True,
        max_position_embeddings=4096,
        tie_word_embeddings=True,
        output_router_logits=True,
        router_aux_loss_coef=args.aux_loss,
        eos_token_id=tok.convert_tokens_to_ids("<|im_end|>"),
        pad_token_id=tok.convert_tokens_to_ids(EOT),
        bos_token_id=None,
        initializer_range=0.02,
    )


def learning_rate(step: int, args) -> float:
    """Linear warm-up, then cosine decay to a tenth of the peak."""
    if step < args.warmup:
        return args.lr * (step + 1) / args.warmup
    frac = (step - args.warmup) / max(1, args.steps - args.warmup)
    return args.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * frac)))


def batches(stream: torch.Tensor, args, gen: torch.Generator):
    """Random windows of ``seq_len + 1`` tokens."""
    while True:
        starts = torch.randint(0, len(stream) - args.seq_len - 1, (args.batch,), generator=gen)
        yield torch.stack([stream[s : s + args.seq_len + 1] for s in starts.tolist()])


@torch.no_grad()
def held_out_loss(model, stream: torch.Tensor, seq_len: int, windows: int = 8) -> float:
    model.eval()
    losses = []
    for i in range(windows):
        chunk = stream[i * seq_len : (i + 1) * seq_len + 1].unsqueeze(0)
        out = model(input_ids=chunk[:, :-1], labels=chunk[:, :-1].clone())
        aux = 0.0 if out.aux_loss is None else model.config.router_aux_loss_coef * out.aux_loss.item()
        losses.append(out.loss.item() - aux)  # the language-model loss alone
    model.train()
    return sum(losses) / len(losses)


def train(args) -> None:
    from tqdm import tqdm
    from transformers import AutoModelForCausalLM

    torch.manual_seed(args.seed)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    docs = corpus(held_out=False)
    chats = chat_pairs(docs, limit=args.chat_samples)
    tok = train_tokenizer(docs, args.vocab, out)
    stream = token_stream(tok, docs, chats, args.seed)
    val = token_stream(tok, corpus(held_out=True), [], args.seed)
    print(f"corpus: {len(docs)} documents, {len(chats)} chat samples, {len(stream) / 1e6:.2f}M tokens "
          f"(held out {len(val) / 1e6:.2f}M); tokenizer {len(tok)} ids; {time.time() - t0:.0f} s", flush=True)

    cfg = model_config(args, tok)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    model.train()
    params = sum(p.numel() for p in model.parameters())
    print(f"model: {params / 1e6:.1f}M parameters ({params * 2 / 2**20:.1f} MiB in bf16)", flush=True)
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2 and "gate.weight" not in n]
    rest = [p for n, p in model.named_parameters() if not (p.dim() >= 2 and "gate.weight" not in n)]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}],
                            lr=args.lr, betas=(0.9, 0.95))
    gen = torch.Generator().manual_seed(args.seed)
    log = []
    bar = tqdm(zip(range(args.steps), batches(stream, args, gen), strict=False), total=args.steps,
               desc="train", mininterval=5)
    for step, batch in bar:
        for group in opt.param_groups:
            group["lr"] = learning_rate(step, args)
        out_ = model(input_ids=batch[:, :-1], labels=batch[:, :-1].clone())
        out_.loss.backward()  # HF shifts labels itself; loss includes coef * aux loss
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        aux = out_.aux_loss.item() if out_.aux_loss is not None else 0.0
        bar.set_postfix(loss=f"{out_.loss.item():.3f}", aux=f"{aux:.3f}")
        if (step + 1) % args.eval_every == 0 or step + 1 == args.steps:
            entry = {"step": step + 1, "loss": round(out_.loss.item(), 4), "aux": round(aux, 4),
                     "held_out_loss": round(held_out_loss(model, val, args.seq_len), 4),
                     "minutes": round((time.time() - t0) / 60, 1)}
            log.append(entry)
            tqdm.write(json.dumps(entry))
    save(model, tok, out, args, log, time.time() - t0)


def save(model, tok, out: Path, args, log: list[dict], seconds: float) -> None:
    """bf16 safetensors in transformers' own (per-expert) layout, plus the recipe and its log."""
    model.config.output_router_logits = False
    model.config.architectures = ["Qwen3MoeForCausalLM"]
    model.to(torch.bfloat16).save_pretrained(str(out))
    tok.save_pretrained(str(out))
    recipe = {"args": vars(args), "python": sys.version.split()[0], "torch": torch.__version__,
              "train_minutes": round(seconds / 60, 1), "log": log}
    (out / "training.json").write_text(json.dumps(recipe, indent=2) + "\n")
    size = sum(p.stat().st_size for p in out.iterdir()) / 2**20
    print(f"saved {out} ({size:.1f} MiB) after {seconds / 60:.1f} min", flush=True)


def parse_args(argv: list[str] | None = None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=str(ROOT / "engine" / "assets" / "hearth-demo"))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--steps", type=int, default=1000)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--warmup", type=int, default=60)
    p.add_argument("--aux-loss", type=float, default=0.1)
    p.add_argument("--vocab", type=int, default=4096)
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--experts", type=int, default=32)
    p.add_argument("--top-k", type=int, default=4)
    p.add_argument("--expert-size", type=int, default=96)
    p.add_argument("--chat-samples", type=int, default=4000)
    p.add_argument("--eval-every", type=int, default=100)
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    return p.parse_args(argv)


if __name__ == "__main__":
    arguments = parse_args()
    if arguments.threads:
        torch.set_num_threads(arguments.threads)
    train(arguments)
