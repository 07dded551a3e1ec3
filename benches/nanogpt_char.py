"""nanoGPT's train.py, one process on the CPU, on a character layout: the PyTorch side of lesson 14's
comparison with ``train --data data/shakespeare_char``.

What it is
    nanoGPT's training loop (github.com/karpathy/nanoGPT, train.py) with its defaults for
    shakespeare_char where they apply: random windows from train.bin (``get_batch``), AdamW with
    weight decay on the 2-D tensors only, warm-up then cosine learning rate (``get_lr``), gradient
    clipping, ``estimate_loss`` every ``--eval-interval`` steps (the mean over ``--eval-iters``
    random batches of each split, in eval mode) and at the end. The model is torch_gpt.py's GPT
    (nanoGPT's architecture and state-dict names, no dropout). What differs from shardlab's run is
    only what cannot be the same: the random batches (torch's generator, not shardlab's) and the
    initial weights (torch's RNG). Same shape, data, hyperparameters, FLOPs per step, one thread
    count, and the clock read the same way (wall time from the first step, evaluations included).

How to run (from the repository root, after `cargo run --release --bin data -- shakespeare`)
    .venv/bin/python benches/nanogpt_char.py --data data/shakespeare_char --n-layer 4 --n-head 4 \
        --n-embd 128 --block-size 64 --batch-size 12 --steps 2000 --lr 1e-3 --min-lr 1e-4 \
        --warmup-iters 100 --lr-decay-iters 2000 --eval-interval 250 --eval-iters 20 --threads 2

Output
    One JSON line per evaluation: {"eval_step", "train_loss", "val_loss", "elapsed_s"}, then a
    summary {"impl": "pytorch-nanogpt", "params", "steps", "val_loss", "best_val_loss",
    "elapsed_s", "tokens_per_s"}. ``--out FILE`` saves the final weights as safetensors
    (nanoGPT's names), which ``train --eval-only --init FILE`` reads.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import torch_gpt  # noqa: E402  (the same GPT as every other PyTorch comparison here)


def get_lr(it, a):
    """nanoGPT's schedule: linear warm-up, cosine decay to min_lr, then min_lr."""
    if it < a.warmup_iters:
        return a.lr * (it + 1) / (a.warmup_iters + 1)
    if it > a.lr_decay_iters:
        return a.min_lr
    ratio = (it - a.warmup_iters) / max(1, a.lr_decay_iters - a.warmup_iters)
    return a.min_lr + 0.5 * (1.0 + math.cos(math.pi * ratio)) * (a.lr - a.min_lr)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--data", required=True, help="a folder with train.bin, val.bin and meta.json")
    p.add_argument("--n-layer", type=int, default=4)
    p.add_argument("--n-head", type=int, default=4)
    p.add_argument("--n-embd", type=int, default=128)
    p.add_argument("--block-size", type=int, default=64)
    p.add_argument("--batch-size", type=int, default=12)
    p.add_argument("--steps", type=int, default=2000)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--min-lr", type=float, default=1e-4)
    p.add_argument("--warmup-iters", type=int, default=100)
    p.add_argument("--lr-decay-iters", type=int, default=2000)
    p.add_argument("--beta2", type=float, default=0.95)
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--grad-clip", type=float, default=1.0)
    p.add_argument("--eval-interval", type=int, default=250)
    p.add_argument("--eval-iters", type=int, default=20)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--seed", type=int, default=1337)
    p.add_argument("--out", default=None, help="save the final weights here (safetensors)")
    a = p.parse_args(argv)

    torch.set_num_threads(a.threads)
    torch.manual_seed(a.seed)
    meta = json.load(open(os.path.join(a.data, "meta.json")))
    split = {s: torch_gpt.load_tokens(os.path.join(a.data, f"{s}.bin")) for s in ("train", "val")}
    model = torch_gpt.GPT(a.n_layer, a.n_head, a.n_embd, a.block_size, meta["vocab_size"])
    params = [q for q in model.parameters() if q.requires_grad]
    opt = torch.optim.AdamW(
        [{"params": [q for q in params if q.dim() >= 2], "weight_decay": a.weight_decay},
         {"params": [q for q in params if q.dim() < 2], "weight_decay": 0.0}],
        lr=a.lr, betas=(0.9, a.beta2), eps=1e-8)
    g = torch.Generator().manual_seed(a.seed)
    B, T = a.batch_size, a.block_size

    @torch.no_grad()
    def estimate_loss():
        model.eval()
        out = {}
        for s in ("train", "val"):
            losses = [model(*torch_gpt.get_batch(split[s], B, T, g))[1].item() for _ in range(a.eval_iters)]
            out[s] = sum(losses) / len(losses)
        model.train()
        return out

    t0 = time.perf_counter()
    best = float("inf")
    last = None
    train_time = 0.0
    model.train()
    for it in range(a.steps + 1):
        if it % a.eval_interval == 0 or it == a.steps:
            l = estimate_loss()
            best = min(best, l["val"])
            last = l
            torch_gpt.emit({"eval_step": it, "train_loss": l["train"], "val_loss": l["val"],
                            "elapsed_s": time.perf_counter() - t0})
        if it == a.steps:
            break
        for group in opt.param_groups:
            group["lr"] = get_lr(it, a)
        x, y = torch_gpt.get_batch(split["train"], B, T, g)
        s0 = time.perf_counter()
        _, loss = model(x, y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        if a.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), a.grad_clip)
        opt.step()
        train_time += time.perf_counter() - s0
    if a.out:
        sd = {k: v.detach().clone().contiguous() for k, v in model.state_dict().items()}
        torch_gpt.save_file(sd, a.out)
    torch_gpt.emit({"impl": "pytorch-nanogpt", "params": torch_gpt.num_params(model), "steps": a.steps,
                    "val_loss": last["val"], "best_val_loss": best, "elapsed_s": time.perf_counter() - t0,
                    "tokens_per_s": B * T * a.steps / train_time, "threads": a.threads})


if __name__ == "__main__":
    main()
