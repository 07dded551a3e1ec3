"""PyTorch DCP reference for shardlab's distributed checkpoints (lesson 10).

What it is
    The same GPT as benches/torch_gpt.py, on --world-size gloo processes, wrapped in FSDP2
    (``fully_shard`` per block and the root: each rank holds its shards) or DDP, one AdamW step
    taken (so the optimizer has its moments), then the model and optimizer state saved with
    ``torch.distributed.checkpoint.save`` (FileSystemWriter: one file per rank plus a .metadata
    file) and loaded back with ``torch.distributed.checkpoint.load`` — the same states shardlab's
    ``train --checkpoint-dir`` / ``--resume`` save and load (f32 parameters, AdamW exp_avg and
    exp_avg_sq).

How to run (from the repository root)
    .venv/bin/python benches/torch_dcp.py --world-size 4 --n-layer 8 --n-embd 768 --n-head 12 \
        --block-size 64 --vocab-size 4096 --dir /tmp/dcp

Output
    One JSON line: {"impl": "pytorch-dcp", "strategy", "world_size", "params", "save_s",
    "load_s", "bytes"}; save_s and load_s are the slowest rank's, between barriers.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shutil
import sys
import time
import warnings

warnings.filterwarnings("ignore")

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import torch_gpt  # noqa: E402


def worker(rank: int, args, port: int, queue) -> None:
    warnings.filterwarnings("ignore")
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=args.world_size, timeout=datetime.timedelta(seconds=600))
    try:
        torch.set_num_threads(1)
        torch.manual_seed(0)
        model = torch_gpt.build_model(args)
        params = torch_gpt.num_params(model)
        if args.strategy == "fsdp":
            model = torch_gpt.wrap_fsdp2(model)
        else:
            model = torch.nn.parallel.DistributedDataParallel(model)
        opt = torch_gpt.configure_optimizer(model, 1e-3)
        x = torch.randint(0, args.vocab_size, (1, args.block_size))
        _, loss = model(x, x)
        loss.backward()
        opt.step()

        def timed(f) -> float:
            dist.barrier()
            t0 = time.perf_counter()
            f()
            dist.barrier()
            t = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
            return t.item()

        msd, osd = get_state_dict(model, opt)
        save_s = timed(lambda: dcp.save({"model": msd, "optim": osd}, checkpoint_id=args.dir))
        msd, osd = get_state_dict(model, opt)

        def load():
            dcp.load({"model": msd, "optim": osd}, checkpoint_id=args.dir)
            set_state_dict(model, opt, model_state_dict=msd, optim_state_dict=osd)

        load_s = timed(load)
        if rank == 0:
            size = sum(os.path.getsize(os.path.join(args.dir, f)) for f in os.listdir(args.dir))
            queue.put({"impl": "pytorch-dcp", "strategy": args.strategy, "world_size": args.world_size,
                       "params": params, "save_s": save_s, "load_s": load_s, "bytes": size})
    finally:
        dist.destroy_process_group()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--n-layer", type=int, default=8)
    p.add_argument("--n-head", type=int, default=12)
    p.add_argument("--n-embd", type=int, default=768)
    p.add_argument("--block-size", type=int, default=64)
    p.add_argument("--vocab-size", type=int, default=4096)
    p.add_argument("--world-size", type=int, default=4)
    p.add_argument("--strategy", choices=("fsdp", "ddp"), default="fsdp")
    p.add_argument("--dir", required=True, help="checkpoint folder (replaced)")
    args = p.parse_args()
    shutil.rmtree(args.dir, ignore_errors=True)
    queue = mp.get_context("spawn").SimpleQueue()
    mp.spawn(worker, args=(args, torch_gpt.free_port(), queue), nprocs=args.world_size, join=True)
    print(json.dumps(queue.get()))


if __name__ == "__main__":
    main()
