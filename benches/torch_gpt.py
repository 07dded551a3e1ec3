"""PyTorch reference GPT for shardlab: the model the Rust code is compared against.

What it is
    A GPT-2-style decoder with exactly nanoGPT's architecture and state-dict
    names (``transformer.wte/wpe/h.{i}/ln_f`` + ``lm_head`` tied to ``wte``,
    pre-LayerNorm blocks, causal SDPA attention, exact-erf GELU MLP, no
    dropout, nanoGPT's init), plus three subcommands:

    init   build the model from ``--seed`` and save its state dict as
           safetensors (``lm_head.weight`` stored as a separate copy of wte).
    eval   load safetensors weights and report the mean cross-entropy over
           every consecutive non-overlapping block-size window of a token file
           (flat little-endian uint16 ids, no header).
    train  tokens/s benchmark of AdamW training, one process ("single") or
           ``--world-size`` gloo processes with DistributedDataParallel ("ddp") or
           FSDP2 (``fully_shard`` per block, then the root: "fsdp");
           ``--checkpointing none|full|every:K`` wraps blocks 0, K, 2K, ... in
           ``torch.utils.checkpoint.checkpoint(block, x, use_reentrant=False)``;
           ``--precision bf16|fp16`` runs the forward under
           ``torch.autocast(device, dtype=...)`` (fp16 with ``torch.amp.GradScaler``);
           ``--device cuda`` (single only) runs it on the GPU, each step timed
           after ``torch.cuda.synchronize()`` (shardlab times CUDA steps to their
           kernels' end the same way), and reports ``cuda_max_allocated_bytes``.
    kernels  the two kernels of one block that lesson 08 times per precision: a
           linear layer of c_attn's shape (B*T rows of n_embd in, 3*n_embd out)
           and causal SDPA on (B, n_head, T, n_embd/n_head), in fp32, bf16 and
           fp16, each the median of ``--reps`` calls after ``--warmup``.

How to run (from the repository root)
    .venv/bin/python benches/torch_gpt.py init --out /tmp/gpt.safetensors
    .venv/bin/python benches/torch_gpt.py eval --weights /tmp/gpt.safetensors --data /tmp/val.bin
    .venv/bin/python benches/torch_gpt.py train --strategy single
    .venv/bin/python benches/torch_gpt.py train --strategy ddp --world-size 2
    Shape options go before the subcommand, e.g.
    .venv/bin/python benches/torch_gpt.py --n-layer 1 --n-embd 32 --n-head 2 \
        --block-size 16 --vocab-size 64 train --steps 6 --warmup 2

Output
    Every subcommand prints one JSON summary line on stdout:
    init  {"saved": path, "params": n}
    eval  {"eval_loss": x, "windows": n, "tokens": n*T}
    kernels {"kernel", "dtype", "shape", "ms_median", "threads"} per kernel and dtype
    train {"impl": "pytorch", "strategy", "world_size", "params", "tokens_per_s",
           "step_s_median", "final_loss", "threads", "checkpointing",
           "peak_rss_bytes"}
    ``train --verbose`` also prints one {"step", "loss", "step_s", "warmup"}
    line per step first.  tokens_per_s = B*T*N / median step time over the
    steps after the first ``--warmup``; for ddp each rank times its steps
    (``dist.barrier()`` then ``time.perf_counter()`` around zero_grad, forward,
    backward and optimizer step) and the slowest rank's median is used;
    final_loss is the last step's loss averaged over ranks.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import socket
import statistics
import sys
import time
import warnings

# torch warns at import time when numpy is absent; irrelevant here.
warnings.filterwarnings("ignore", message=".*Failed to initialize NumPy.*")

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
import torch.nn.functional as F
import torch.utils.checkpoint

try:
    from safetensors.torch import load_file, save_file
except ImportError:  # safetensors.torch needs the `packaging` module; fall back to the core API
    import ctypes

    from safetensors import safe_open, serialize_file

    def load_file(path):
        with safe_open(path, framework="pt") as f:
            return {k: f.get_tensor(k) for k in f.keys()}

    def save_file(tensors, path):
        serialize_file({k: {"dtype": str(t.dtype).removeprefix("torch."), "shape": list(t.shape),
                            "data": ctypes.string_at(t.data_ptr(), t.nbytes)}
                        for k, t in tensors.items()}, path, None)


# ------------------------------------------------------------------------ model
class CausalSelfAttention(nn.Module):
    def __init__(self, n_embd: int, n_head: int):
        super().__init__()
        assert n_embd % n_head == 0, "n_embd must be divisible by n_head"
        self.n_head = n_head
        self.c_attn = nn.Linear(n_embd, 3 * n_embd)
        self.c_proj = nn.Linear(n_embd, n_embd)

    def forward(self, x):
        B, T, C = x.shape
        qkv = self.c_attn(x)
        # Under tensor parallelism c_attn is column-parallel: this rank's 3·C/t columns hold the
        # q, k and v of its n_head/t heads (see tp_shard_rows), so split what is here.
        c = qkv.size(-1) // 3
        heads = self.n_head * c // C
        q, k, v = qkv.split(c, dim=2)
        # (B, T, c) -> (B, heads, T, head_dim)
        q, k, v = (t.view(B, T, heads, c // heads).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.c_proj(y.transpose(1, 2).contiguous().view(B, T, c))


class MLP(nn.Module):
    def __init__(self, n_embd: int):
        super().__init__()
        self.c_fc = nn.Linear(n_embd, 4 * n_embd)
        self.gelu = nn.GELU()  # exact (erf) GELU
        self.c_proj = nn.Linear(4 * n_embd, n_embd)

    def forward(self, x):
        return self.c_proj(self.gelu(self.c_fc(x)))


class Block(nn.Module):
    def __init__(self, n_embd: int, n_head: int):
        super().__init__()
        self.ln_1 = nn.LayerNorm(n_embd, eps=1e-5)
        self.attn = CausalSelfAttention(n_embd, n_head)
        self.ln_2 = nn.LayerNorm(n_embd, eps=1e-5)
        self.mlp = MLP(n_embd)

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self, n_layer, n_head, n_embd, block_size, vocab_size):
        super().__init__()
        self.block_size, self.vocab_size = block_size, vocab_size
        self.checkpoint_every = 0  # 0: no checkpointing; K: checkpoint blocks 0, K, 2K, ...
        self.transformer = nn.ModuleDict(dict(
            wte=nn.Embedding(vocab_size, n_embd),
            wpe=nn.Embedding(block_size, n_embd),
            h=nn.ModuleList([Block(n_embd, n_head) for _ in range(n_layer)]),
            ln_f=nn.LayerNorm(n_embd, eps=1e-5),
        ))
        self.lm_head = nn.Linear(n_embd, vocab_size, bias=False)
        self.transformer.wte.weight = self.lm_head.weight  # weight tying, as nanoGPT
        self.apply(self._init_weights)
        for name, p in self.named_parameters():  # scaled init of residual projections
            if name.endswith("c_proj.weight"):
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * n_layer))

    @staticmethod
    def _init_weights(module):
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    def forward(self, idx, targets=None):
        _, T = idx.shape
        assert T <= self.block_size, f"sequence length {T} > block size {self.block_size}"
        pos = torch.arange(T, dtype=torch.long, device=idx.device)
        x = self.transformer.wte(idx) + self.transformer.wpe(pos)
        for i, block in enumerate(self.transformer.h):
            if self.checkpoint_every and i % self.checkpoint_every == 0:
                # Activation checkpointing: keep only the block's input, recompute it in backward.
                x = torch.utils.checkpoint.checkpoint(block, x, use_reentrant=False)
            else:
                x = block(x)
        logits = self.lm_head(self.transformer.ln_f(x))
        loss = None
        if targets is not None:
            loss = F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1), ignore_index=-1)
        return logits, loss


def build_model(args) -> GPT:
    return GPT(args.n_layer, args.n_head, args.n_embd, args.block_size, args.vocab_size)


def num_params(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())  # the tied weight is counted once


def configure_optimizer(model: nn.Module, lr: float, impl: str = "default") -> torch.optim.AdamW:
    """nanoGPT's AdamW groups. ``impl``: "default" is PyTorch's choice (foreach, multi-tensor, on
    CUDA); "per-tensor" (foreach=False) steps one tensor at a time as shardlab does (tch exposes
    neither the foreach nor the fused kernels), for a like-for-like comparison of the step."""
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [
        {"params": [p for p in params if p.dim() >= 2], "weight_decay": 0.1},
        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
    ]
    extra = {"foreach": False} if impl == "per-tensor" else {}
    return torch.optim.AdamW(groups, lr=lr, betas=(0.9, 0.95), eps=1e-8, **extra)


def load_tokens(path: str) -> torch.Tensor:
    raw = bytearray(open(path, "rb").read())
    if len(raw) % 2:
        sys.exit(f"error: {path} has an odd number of bytes; expected flat uint16 tokens")
    if sys.byteorder == "big":  # file is little-endian: swap byte pairs
        raw[0::2], raw[1::2] = raw[1::2], raw[0::2]
    if not raw:
        return torch.empty(0, dtype=torch.int64)
    return torch.frombuffer(raw, dtype=torch.uint16).to(torch.int64)


def emit(obj) -> None:
    print(json.dumps(obj), flush=True)


# ------------------------------------------------------------------- init / eval
def cmd_init(args) -> None:
    torch.manual_seed(args.seed)
    model = build_model(args)
    sd = {k: v.detach().clone().contiguous() for k, v in model.state_dict().items()}
    save_file(sd, args.out)  # lm_head.weight is its own copy: save_file refuses shared tensors
    emit({"saved": args.out, "params": num_params(model)})


@torch.no_grad()
def cmd_eval(args) -> None:
    model = build_model(args)
    sd = load_file(args.weights)
    if "lm_head.weight" not in sd and "transformer.wte.weight" in sd:
        sd["lm_head.weight"] = sd["transformer.wte.weight"]
    model.load_state_dict(sd, strict=True)
    model.eval()
    tokens = load_tokens(args.data)
    T = args.block_size
    n = (len(tokens) - 1) // T if len(tokens) > 0 else 0
    if n <= 0:
        sys.exit(f"error: {args.data} has {len(tokens)} tokens; need at least block_size+1 = {T + 1}")
    inputs = tokens[: n * T].view(n, T)
    targets = tokens[1 : n * T + 1].view(n, T)
    total = 0.0
    for i in range(0, n, args.batch):
        x, y = inputs[i : i + args.batch], targets[i : i + args.batch]
        _, loss = model(x, y)
        total += loss.item() * x.size(0)  # every window has T tokens
    emit({"eval_loss": total / n, "windows": n, "tokens": n * T})


# ------------------------------------------------------------------------ train
def train_data(args) -> torch.Tensor:
    if args.data:
        data = load_tokens(args.data)
    else:
        g = torch.Generator().manual_seed(args.seed + 12345)
        data = torch.randint(0, args.vocab_size, (args.random_tokens,), generator=g)
    if len(data) < args.block_size + 2:
        sys.exit(f"error: need more than block_size+1 = {args.block_size + 1} training tokens")
    return data


def get_batch(data, B, T, g):
    ix = torch.randint(len(data) - T, (B,), generator=g)
    x = torch.stack([data[i : i + T] for i in ix.tolist()])
    y = torch.stack([data[i + 1 : i + T + 1] for i in ix.tolist()])
    return x, y


def wrap_fsdp2(model: nn.Module, reshard_after_forward: bool = True, param_dtype=None) -> nn.Module:
    """FSDP2: `fully_shard` every transformer block, then the root (embeddings, ln_f, lm_head).
    `reshard_after_forward=False` keeps each block's gathered parameters from its forward to its
    backward (one all-gather per block per step instead of two). `param_dtype` (bf16/fp16): gather
    the parameters in it, reduce gradients in fp32 (MixedPrecisionPolicy, as shardlab's ZeRO with
    --precision bf16 and the default reduce dtype)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32)
    for block in model.transformer.h:
        fully_shard(block, mesh=mesh, reshard_after_forward=reshard_after_forward, mp_policy=mp)
    fully_shard(model, mesh=mesh, mp_policy=mp)
    return model


def wrap_tp(model: GPT, world_size: int) -> GPT:
    """Megatron tensor parallelism with DTensor (torch.distributed.tensor.parallel) over all the
    ranks: in every block c_attn and c_fc column-parallel, the two c_proj row-parallel (one
    all-reduce each in forward, one each for the input gradient in backward). c_attn's rows are
    first reordered so that rank r's contiguous slice holds the q, k and v rows of its heads, as
    shardlab's TpBlock takes them. The embeddings, LayerNorms and the tied head stay replicated:
    every rank computes the full logits (shardlab splits the vocabulary instead)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    n_head = model.transformer.h[0].attn.n_head
    if n_head % world_size:
        sys.exit(f"error: {n_head} heads do not split over {world_size} tensor-parallel ranks")
    mesh = init_device_mesh("cpu", (world_size,))
    C = model.transformer.wte.weight.size(1)
    c = C // world_size
    order = torch.cat([torch.arange(r * c, (r + 1) * c) + j * C for r in range(world_size) for j in range(3)])
    for block in model.transformer.h:
        with torch.no_grad():
            block.attn.c_attn.weight.copy_(block.attn.c_attn.weight[order])
            block.attn.c_attn.bias.copy_(block.attn.c_attn.bias[order])
        parallelize_module(block, mesh, {
            "attn.c_attn": ColwiseParallel(), "attn.c_proj": RowwiseParallel(),
            "mlp.c_fc": ColwiseParallel(), "mlp.c_proj": RowwiseParallel(),
        })
    return model


def parse_checkpointing(s: str) -> int:
    """none -> 0, full -> 1, every:K -> K (shardlab's --activation-checkpointing values)."""
    if s == "none":
        return 0
    if s == "full":
        return 1
    if s.startswith("every:") and s[6:].isdigit() and int(s[6:]) >= 1:
        return int(s[6:])
    sys.exit(f"error: --checkpointing is none, full or every:K, not {s!r}")


def peak_rss_bytes() -> int:
    """This process's peak resident set size (VmHWM), as shardlab's bench::peak_rss_bytes."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    return 0


def train_loop(args, rank: int, world_size: int, ddp: bool) -> dict:
    torch.set_num_threads(args.threads)
    data = train_data(args)
    torch.manual_seed(args.seed)  # same init on every rank (DDP also broadcasts rank 0's)
    model = build_model(args)
    dev = torch.device(args.device)
    model.to(dev)
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    model.checkpoint_every = parse_checkpointing(args.checkpointing)
    params = num_params(model)
    model.train()
    # Mixed precision as PyTorch's recipe: fp32 parameters, gradients and optimizer; the autocast
    # region casts the matmuls (linear, SDPA) to bf16/fp16; fp16 adds a GradScaler. FSDP2 also
    # gathers its parameters in that dtype (MixedPrecisionPolicy), as shardlab's ZeRO does.
    amp_dtype = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}[args.precision]
    scaler = torch.amp.GradScaler(dev.type) if args.precision == "fp16" else None
    tp = ddp and args.strategy == "tp"
    if ddp and args.strategy == "fsdp":
        model = wrap_fsdp2(model, reshard_after_forward=not args.no_reshard_after_forward, param_dtype=amp_dtype)
    elif tp:
        model = wrap_tp(model, world_size)
    elif ddp:
        model = nn.parallel.DistributedDataParallel(model)
    opt = configure_optimizer(model, args.lr, getattr(args, "adamw", "default"))
    # Different rows per rank; under tp every rank reads the same rows, the whole global batch.
    g = torch.Generator().manual_seed(args.seed + 1 + (0 if tp else rank))
    B, T = args.batch_size * (world_size if tp else 1), args.block_size
    times, loss = [], None
    for step in range(args.steps):
        x, y = get_batch(data, B, T, g)
        x, y = x.to(dev), y.to(dev)
        if ddp:
            dist.barrier()
        sync()
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        with torch.autocast(dev.type, dtype=amp_dtype, enabled=amp_dtype is not None):
            _, loss = model(x, y)
        if scaler is None:
            loss.backward()
            opt.step()
        else:
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
        sync()
        dt = time.perf_counter() - t0
        times.append(dt)
        if args.verbose and rank == 0:
            emit({"step": step, "loss": loss.item(), "step_s": dt, "warmup": step < args.warmup})
    median = statistics.median(times[args.warmup :])
    final_loss = loss.item()
    if ddp:  # slowest rank's median, mean final loss
        t = torch.tensor([median], dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        lt = torch.tensor([final_loss], dtype=torch.float64)
        dist.all_reduce(lt, op=dist.ReduceOp.SUM)
        median, final_loss = t.item(), lt.item() / world_size
    return {
        "impl": "pytorch", "strategy": args.strategy, "world_size": world_size, "params": params,
        "tokens_per_s": B * T * (1 if tp else world_size) / median, "step_s_median": median,
        "final_loss": final_loss, "threads": args.threads, "checkpointing": args.checkpointing,
        "precision": args.precision,
        "peak_rss_bytes": peak_rss_bytes(), "device": args.device, "adamw": getattr(args, "adamw", "default"),
        "cuda_max_allocated_bytes": torch.cuda.max_memory_allocated(dev) if dev.type == "cuda" else None,
        # device-wide, as shardlab's cudaMemGetInfo figure (context, allocator cache, every process)
        "cuda_used_bytes": (lambda f, t: t - f)(*torch.cuda.mem_get_info(dev)) if dev.type == "cuda" else None,
    }


def ddp_worker(rank: int, args, port: int, queue) -> None:
    warnings.filterwarnings("ignore", message=".*Failed to initialize NumPy.*")
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=args.world_size, timeout=datetime.timedelta(seconds=300))
    try:
        result = train_loop(args, rank, args.world_size, ddp=True)
        if rank == 0:
            queue.put(result)
    finally:
        dist.destroy_process_group()


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def cmd_train(args) -> None:
    if args.steps <= args.warmup:
        sys.exit("error: --steps must be larger than --warmup")
    if args.device != "cpu" and args.strategy != "single":
        sys.exit("error: --device cuda runs --strategy single (the ranks here talk over gloo)")
    if args.strategy == "single":
        if args.world_size != 1:
            print("note: --strategy single ignores --world-size", file=sys.stderr)
        emit(train_loop(args, 0, 1, ddp=False))
        return
    queue = mp.get_context("spawn").SimpleQueue()
    mp.spawn(ddp_worker, args=(args, free_port(), queue), nprocs=args.world_size, join=True)
    emit(queue.get())


# ---------------------------------------------------------------------- kernels
def cmd_kernels(args) -> None:
    B, T, C, H = args.batch_size, args.block_size, args.n_embd, args.n_head
    g = torch.Generator().manual_seed(args.seed)
    for dtype in ("fp32", "bf16", "fp16"):
        dt = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[dtype]
        x = torch.randn(B * T, C, generator=g).to(dt)
        w = torch.randn(3 * C, C, generator=g).to(dt)
        q, k, v = (torch.randn(B, H, T, C // H, generator=g).to(dt) for _ in range(3))
        cases = [
            ("linear", f"({B * T}, {C}) x ({3 * C}, {C})^T", lambda: F.linear(x, w)),
            ("sdpa", f"({B}, {H}, {T}, {C // H}) causal", lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True)),
        ]
        for name, shape, f in cases:
            times = []
            with torch.no_grad():
                for i in range(args.warmup + args.reps):
                    t0 = time.perf_counter()
                    f()
                    if i >= args.warmup:
                        times.append(time.perf_counter() - t0)
            print(json.dumps({"kernel": name, "dtype": dtype, "shape": shape,
                              "ms_median": round(statistics.median(times) * 1e3, 2), "threads": args.threads}))


# -------------------------------------------------------------------------- CLI
def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--n-layer", type=int, default=4)
    p.add_argument("--n-head", type=int, default=4)
    p.add_argument("--n-embd", type=int, default=256)
    p.add_argument("--block-size", type=int, default=128)
    p.add_argument("--vocab-size", type=int, default=4096)
    p.add_argument("--threads", type=int, default=1, help="torch.set_num_threads (per process)")
    sub = p.add_subparsers(dest="cmd", required=True)

    e = sub.add_parser("eval", help="mean loss over all non-overlapping windows of a token file")
    e.add_argument("--weights", required=True, help="safetensors file")
    e.add_argument("--data", required=True, help="flat little-endian uint16 token ids")
    e.add_argument("--batch", type=int, default=16, help="windows per forward pass")
    e.set_defaults(func=cmd_eval)

    i = sub.add_parser("init", help="save a freshly initialised model as safetensors")
    i.add_argument("--out", required=True)
    i.add_argument("--seed", type=int, default=0)
    i.set_defaults(func=cmd_init)

    k = sub.add_parser("kernels", help="one block's linear and SDPA timed in fp32, bf16 and fp16")
    k.add_argument("--batch-size", type=int, default=8, help="sequences")
    k.add_argument("--reps", type=int, default=20)
    k.add_argument("--warmup", type=int, default=3)
    k.add_argument("--seed", type=int, default=0)
    k.set_defaults(func=cmd_kernels)

    t = sub.add_parser("train", help="tokens/s training benchmark")
    t.add_argument("--strategy", choices=("single", "ddp", "fsdp", "tp"), default="single",
                   help="tp: DTensor tensor parallelism over all the ranks, the global batch on each")
    t.add_argument("--world-size", type=int, default=1)
    t.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    t.add_argument("--batch-size", type=int, default=8, help="sequences per rank per step")
    t.add_argument("--steps", type=int, default=30)
    t.add_argument("--warmup", type=int, default=5, help="leading steps excluded from the median")
    t.add_argument("--lr", type=float, default=1e-3)
    t.add_argument("--data", default=None, help="uint16 token file (default: random tokens)")
    t.add_argument("--random-tokens", type=int, default=1 << 20, help="size of the random corpus")
    t.add_argument("--seed", type=int, default=0)
    t.add_argument("--verbose", action="store_true", help="one JSON line per step")
    t.add_argument("--no-reshard-after-forward", action="store_true",
                   help="fsdp: fully_shard(block, reshard_after_forward=False)")
    t.add_argument("--precision", choices=("fp32", "bf16", "fp16"), default="fp32",
                   help="fp32, or torch.autocast(device, dtype=bf16/fp16) around the forward (fp16: GradScaler)")
    t.add_argument("--adamw", choices=("default", "per-tensor"), default="default",
                   help="PyTorch's AdamW as it chooses (foreach on CUDA), or one tensor at a time (foreach=False) as shardlab")
    t.add_argument("--checkpointing", default="none",
                   help="activation checkpointing: none, full or every:K (torch.utils.checkpoint per block)")
    t.set_defaults(func=cmd_train)
    return p.parse_args(argv)


def main(argv=None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    args.func(args)


if __name__ == "__main__":
    main()
