"""Train fulcrum's bundled models on tinyshakespeare: a byte-level BPE tokenizer, a Llama target
model and a small draft model (for speculative decoding), saved in Hugging Face format.

    python scripts/train_tiny.py --data ../shared/data/tinyshakespeare.txt --out fulcrum/bundled

The last 10% of the corpus is held out for validation and never trained on.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import time
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

SPECIAL_TOKENS = ["<|endoftext|>", "<|system|>", "<|user|>", "<|assistant|>", "<|end|>"]
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{% if message['role'] not in ['system', 'user', 'assistant'] %}"
    "{{ raise_exception('unknown role: ' + message['role']) }}{% endif %}"
    "<|{{ message['role'] }}|>\n{{ message['content'] }}<|end|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)

# name -> (hidden, layers, heads, kv_heads, intermediate)
SIZES = {
    "target": (256, 8, 8, 4, 768),
    "draft": (96, 2, 4, 2, 256),
}


def split_corpus(text: str) -> tuple[str, str]:
    cut = int(len(text) * 0.9)
    return text[:cut], text[cut:]


def speaker_turns(text: str) -> list[str]:
    """Shakespeare's turns are blocks separated by blank lines, each opening with 'NAME:'."""
    return [t.strip() for t in text.split("\n\n") if t.strip()]


def train_tokenizer(train_text: str, vocab_size: int) -> PreTrainedTokenizerFast:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator([train_text[i : i + 4096] for i in range(0, len(train_text), 4096)], trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|endoftext|>",
        bos_token="<|endoftext|>",
        pad_token="<|endoftext|>",
        chat_template=CHAT_TEMPLATE,
        model_max_length=1024,
        clean_up_tokenization_spaces=False,
    )


def encode_stream(tok: PreTrainedTokenizerFast, text: str, seed: int) -> torch.Tensor:
    """Plain text, then chat-formatted pairs of consecutive turns, so the chat template means something."""
    ids = tok(text)["input_ids"]
    turns = speaker_turns(text)
    rng = random.Random(seed)
    chats = []
    for i in rng.sample(range(len(turns) - 1), k=(len(turns) - 1) // 3):
        msgs = [{"role": "user", "content": turns[i]}, {"role": "assistant", "content": turns[i + 1]}]
        chats.extend(tok.apply_chat_template(msgs, tokenize=True, return_dict=False) + [tok.eos_token_id])
    return torch.tensor(ids + [tok.eos_token_id] + chats, dtype=torch.long)


def make_config(name: str, vocab_size: int, tok: PreTrainedTokenizerFast, ctx: int) -> LlamaConfig:
    hidden, layers, heads, kv_heads, inter = SIZES[name]
    return LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=hidden,
        intermediate_size=inter,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=ctx,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        tie_word_embeddings=True,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
    )


@torch.no_grad()
def evaluate(model, data: torch.Tensor, seq_len: int, max_windows: int | None = 64) -> float:
    """Mean loss over non-overlapping windows (the first `max_windows`, or all of them)."""
    model.eval()
    starts = list(range(0, len(data) - seq_len - 1, seq_len))[:max_windows]
    losses = []
    for i in range(0, len(starts), 16):
        x = torch.stack([data[s : s + seq_len] for s in starts[i : i + 16]])
        y = torch.stack([data[s + 1 : s + seq_len + 1] for s in starts[i : i + 16]])
        logits = model(input_ids=x).logits.float()
        losses.append(torch.nn.functional.cross_entropy(logits.flatten(0, 1), y.flatten(), reduction="sum"))
    model.train()
    return float(sum(losses) / (len(starts) * seq_len))


def add_residual_dropout(model: LlamaForCausalLM, p: float) -> None:
    """Dropout on each attention and MLP output before the residual add (as GPT-2 and nanoGPT do);
    transformers' Llama has none, and the corpus is small enough that the target overfits without it.
    Hooks are not saved: the exported model is a plain Llama."""
    if p <= 0:
        return
    for layer in model.model.layers:
        layer.self_attn.register_forward_hook(
            lambda m, i, o: (torch.nn.functional.dropout(o[0], p, m.training), *o[1:])
        )
        layer.mlp.register_forward_hook(lambda m, i, o: torch.nn.functional.dropout(o, p, m.training))


def train_model(name, cfg, train_ids, val_ids, args) -> dict:
    torch.manual_seed(args.seed)
    model = LlamaForCausalLM(cfg)
    add_residual_dropout(model, args.dropout[name])
    n_params = sum(p.numel() for p in model.parameters())
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1)
    budget = args.minutes[name] * 60
    warmup = 100
    gen = torch.Generator().manual_seed(args.seed)
    t0 = time.time()
    step, best, best_state, log = 0, float("inf"), None, []
    train_loss = float("nan")
    while True:
        elapsed = time.time() - t0
        if elapsed > budget:
            break
        # cosine schedule over the wall-clock budget
        frac = min(elapsed / budget, 1.0)
        lr = args.lr * min(1.0, (step + 1) / warmup) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * frac)))
        for g in opt.param_groups:
            g["lr"] = lr
        ix = torch.randint(0, len(train_ids) - args.seq_len - 1, (args.batch_size,), generator=gen)
        x = torch.stack([train_ids[i : i + args.seq_len] for i in ix])
        y = torch.stack([train_ids[i + 1 : i + args.seq_len + 1] for i in ix])
        with torch.autocast("cpu", dtype=torch.bfloat16):
            logits = model(input_ids=x).logits
        loss = torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), y.flatten())
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        train_loss = 0.9 * train_loss + 0.1 * loss.item() if step else loss.item()
        step += 1
        if step % args.eval_every == 0:
            val = evaluate(model, val_ids, args.seq_len)
            log.append({"step": step, "minutes": round((time.time() - t0) / 60, 2), "train": train_loss, "val": val})
            print(f"[{name}] step {step} {log[-1]['minutes']} min train {train_loss:.3f} val {val:.3f}", flush=True)
            if val < best:
                best, best_state = val, {k: v.clone() for k, v in model.state_dict().items()}
    wall = time.time() - t0
    if best_state is not None:
        model.load_state_dict(best_state)
    final_train = evaluate(model, train_ids, args.seq_len)
    final_val = evaluate(model, val_ids, args.seq_len, max_windows=None)
    return {
        "model": model,
        "params": n_params,
        "steps": step,
        "wall_minutes": round(wall / 60, 1),
        "train_loss": round(final_train, 4),
        "val_loss": round(final_val, 4),
        "log": log,
    }


def write_card(path: Path, name: str, res: dict, cfg: LlamaConfig, args, command: str) -> None:
    hidden, layers, heads, kv_heads, inter = SIZES[name]
    role = "fulcrum's default model" if name == "target" else "draft model for speculative decoding"
    card = f"""# fulcrum tiny-shakespeare {name}

{role.capitalize()}: a Llama-architecture model (GQA, RoPE, SwiGLU, RMSNorm, tied embeddings)
trained from scratch by `scripts/train_tiny.py` on these CPU cores. It writes Shakespeare-like text.

| | |
|---|---|
| data | tinyshakespeare (karpathy/char-rnn, public domain), first 90% for training, last 10% held out |
| training data mix | plain text plus chat-formatted pairs of consecutive speaker turns |
| tokenizer | byte-level BPE, vocabulary {cfg.vocab_size}, chat template in `chat_template.jinja` |
| parameters | {res["params"]:,} |
| shape | hidden {hidden}, {layers} layers, {heads} heads, {kv_heads} KV heads, head dim {hidden // heads}, intermediate {inter} |
| context | {cfg.max_position_embeddings} tokens (trained on windows of {args.seq_len}) |
| steps | {res["steps"]} (batch {args.batch_size} x {args.seq_len} tokens, AdamW, bf16 autocast, residual dropout {args.dropout[name]}) |
| wall time | {res["wall_minutes"]} minutes on 2 CPU cores |
| train loss | {res["train_loss"]} nats/token (best checkpoint, evaluated on 64 windows) |
| validation loss | {res["val_loss"]} nats/token (the whole held-out 10%; checkpoint chosen on its first 64 windows) |

Training command (run from the repository root):

```
{command}
```

Weights are stored in float32 (`save_pretrained`, safetensors).
"""
    (path / "README.md").write_text(card)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data", required=True, help="path to tinyshakespeare.txt")
    p.add_argument("--out", default="fulcrum/bundled")
    p.add_argument("--vocab-size", type=int, default=2048)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--target-minutes", type=float, default=22)
    p.add_argument("--draft-minutes", type=float, default=5)
    p.add_argument("--eval-every", type=int, default=100)
    p.add_argument("--target-dropout", type=float, default=0.0)
    p.add_argument("--draft-dropout", type=float, default=0.0)
    p.add_argument("--only", choices=["target", "draft"], default=None)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    args.minutes = {"target": args.target_minutes, "draft": args.draft_minutes}
    args.dropout = {"target": args.target_dropout, "draft": args.draft_dropout}
    command = "python scripts/train_tiny.py " + " ".join(
        f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items() if k not in ("minutes", "only") and v is not None
    )
    torch.set_num_threads(2)

    text = Path(args.data).read_text(encoding="utf-8")
    train_text, val_text = split_corpus(text)
    tok = train_tokenizer(train_text, args.vocab_size)
    vocab = len(tok)
    train_ids = encode_stream(tok, train_text, args.seed)
    val_ids = torch.tensor(tok(val_text)["input_ids"], dtype=torch.long)
    print(f"tokenizer vocab {vocab}; train {len(train_ids)} tokens, val {len(val_ids)} tokens", flush=True)

    out = Path(args.out)
    summary = {}
    for name in ["draft", "target"]:
        if args.only and name != args.only:
            continue
        cfg = make_config(name, vocab, tok, ctx=1024)
        res = train_model(name, cfg, train_ids, val_ids, args)
        folder = out / f"tiny-shakespeare-{name}"
        folder.mkdir(parents=True, exist_ok=True)
        res["model"].generation_config.eos_token_id = [tok.eos_token_id, tok.convert_tokens_to_ids("<|end|>")]
        res["model"].generation_config.bos_token_id = tok.bos_token_id
        res["model"].generation_config.pad_token_id = tok.pad_token_id
        res["model"].to(torch.float32).save_pretrained(folder)
        tok.save_pretrained(folder)
        write_card(folder, name, res, cfg, args, command)
        (folder / "training_log.json").write_text(json.dumps(res["log"], indent=1))
        summary[name] = {k: res[k] for k in ("params", "steps", "wall_minutes", "train_loss", "val_loss")}
        print(name, summary[name], flush=True)
    print(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
