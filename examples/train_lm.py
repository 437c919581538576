#!/usr/bin/env python
"""Fine-tune a tiny causal language model on a token file with packed, token-budget batches.

    python examples/train_lm.py [--data PATH] [--epochs 2] [--max-tokens 1024] [--workers 2]
                                [--checkpoint ckpt.pt] [--max-steps N] [--device cpu|cuda]

Without --data it writes a small byte-level corpus first (`pooled_loader.tokens.write_tokens`);
make your own with ``python -m pooled_loader tokens write OUT --from TEXTS --tokenizer mod:fn``.
Every batch is one packed row of documents (`collate.packed()`: values, cu_seqlens, position ids)
written by the workers into the pool; attention stays inside each document. With --checkpoint the
model, the optimiser and the loader's position are saved every --save-every steps: run the same
command again and it continues from the saved batch.
"""
from __future__ import annotations

import argparse
import os
import tempfile

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from tqdm import tqdm

from pooled_loader import PooledLoader
from pooled_loader.collate import packed
from pooled_loader.samplers import TokenBudgetBatchSampler
from pooled_loader.tokens import TokenDataset, write_tokens

DEMO_DOCS = 400
WORDS = ("the cat dog sat ran on under a mat log sun hill and then slept quickly happily "
         "red small big old").split()


def demo_corpus(path: str, docs: int = DEMO_DOCS, seed: int = 0) -> None:
    """Byte-level documents of simple sentences (a learnable toy language), 20-400 bytes."""
    rng = np.random.default_rng(seed)
    texts = []
    for _ in range(docs):
        words = rng.choice(WORDS, size=int(rng.integers(4, 70)))
        texts.append((" ".join(words) + ".").encode())
    write_tokens(path, (np.frombuffer(t, np.uint8) for t in texts), dtype=np.uint16)


class Block(nn.Module):
    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.heads = heads
        self.norm1, self.norm2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.qkv, self.out = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
        t, dim = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(t, 3, self.heads, dim // self.heads).unbind(1)
        attn = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1),
                                              v.transpose(0, 1), attn_mask=allowed)
        x = x + self.out(attn.transpose(0, 1).reshape(t, dim))
        return x + self.mlp(self.norm2(x))


class TinyLM(nn.Module):
    """A causal transformer over one packed row of documents."""

    def __init__(self, vocab: int, dim: int = 64, heads: int = 4, layers: int = 2,
                 max_len: int = 512):
        super().__init__()
        self.tok, self.pos = nn.Embedding(vocab, dim), nn.Embedding(max_len, dim)
        self.blocks = nn.ModuleList(Block(dim, heads) for _ in range(layers))
        self.head = nn.Linear(dim, vocab)

    def forward(self, ids: torch.Tensor, position_ids: torch.Tensor,
                cu_seqlens: torch.Tensor) -> torch.Tensor:
        doc = torch.repeat_interleave(torch.arange(len(cu_seqlens) - 1, device=ids.device),
                                      (cu_seqlens[1:] - cu_seqlens[:-1]).long())
        t = torch.arange(len(ids), device=ids.device)
        allowed = (doc[:, None] == doc[None, :]) & (t[None, :] <= t[:, None])  # causal, per doc
        x = self.tok(ids) + self.pos(position_ids)
        for block in self.blocks:
            x = block(x, allowed)
        return self.head(x)


def lm_loss(logits: torch.Tensor, ids: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
    """Next-token loss; a document's last token predicts nothing (the next one starts another)."""
    same_doc = position_ids[1:] != 0
    return F.cross_entropy(logits[:-1][same_doc], ids[1:][same_doc])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", help="token file (PATH.bin + PATH.idx); default: a demo corpus")
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--max-tokens", type=int, default=1024, help="tokens per packed batch")
    parser.add_argument("--max-len", type=int, default=256, help="documents are cut to this")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--checkpoint", help="save/resume model, optimiser and loader here")
    parser.add_argument("--save-every", type=int, default=20)
    parser.add_argument("--max-steps", type=int, default=0, help="stop after this many steps")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch CPU threads: one is fastest for a model this small (more "
                             "spin and wait on a shared machine, 10x slower measured)")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    data = args.data
    if data is None:
        data = os.path.join(tempfile.gettempdir(), f"pooled_loader_demo_tokens_{DEMO_DOCS}")
        if not os.path.exists(data + ".idx"):
            demo_corpus(data)
    dataset = TokenDataset(data, max_len=args.max_len)
    sampler = TokenBudgetBatchSampler(dataset.lengths(), args.max_tokens, packing=True, seed=0)
    loader = PooledLoader(dataset, batch_sampler=sampler, num_workers=args.workers,
                          persistent_workers=args.workers > 0, collate_fn=packed(dtype=torch.int64),
                          device=args.device if args.device.startswith("cuda") else None)
    vocab = max(256, dataset.max_id() + 1)  # one pass over the mapped file
    device = torch.device(args.device)
    model = TinyLM(vocab, max_len=args.max_len).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
    epoch = step = 0
    if args.checkpoint and os.path.exists(args.checkpoint):
        saved = torch.load(args.checkpoint, weights_only=False)
        model.load_state_dict(saved["model"])
        opt.load_state_dict(saved["optim"])
        loader.load_state_dict(saved["loader"])
        epoch, step = saved["epoch"], saved["step"]
        print(f"resumed at epoch {epoch}, step {step}")

    def save() -> None:
        if args.checkpoint:
            torch.save({"model": model.state_dict(), "optim": opt.state_dict(),
                        "loader": loader.state_dict(), "epoch": epoch, "step": step},
                       args.checkpoint)

    loss = torch.tensor(float("nan"))
    while epoch < args.epochs:
        loader.set_epoch(epoch)
        bar = tqdm(loader, desc=f"epoch {epoch}", unit="batch", leave=False)
        for batch in bar:
            ids = batch.values.to(device, non_blocking=True)
            positions = batch.position_ids.to(device, non_blocking=True)
            logits = model(ids, positions, batch.cu_seqlens.to(device))
            loss = lm_loss(logits, ids, positions)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            step += 1
            bar.set_postfix(loss=f"{loss.item():.3f}", tokens=len(ids))
            if step % args.save_every == 0:
                save()
            if args.max_steps and step >= args.max_steps:
                break
        else:
            epoch += 1
            continue
        break
    save()
    print(f"steps {step}, epoch {epoch}, loss {loss.item():.3f}")
    print(loader.report())
    loader.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
