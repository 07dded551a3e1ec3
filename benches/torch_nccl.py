"""PyTorch's own NCCL per-call time at world size 1, to print beside shardlab's (lesson 11).

What it is
    One process joins a torch.distributed "nccl" group of one rank on cuda:0 and times
    all_reduce (SUM) and all_gather_into_tensor on float32 tensors of the given sizes.
    At world size 1 no byte crosses a link: the time is NCCL's cost per call (launch,
    kernel, completion), which is what shardlab's ``collectives --backend nccl
    --world-size 1`` measures for its own calls.

How to run (on a CUDA machine, from the repository root)
    python3 benches/torch_nccl.py --sizes 4K,1M,64M --iters 20

Method (like for like with shardlab's blocking calls)
    After 3 warm-up calls, ``--iters`` calls back to back, each followed by
    ``torch.cuda.synchronize()`` (shardlab's blocking call returns once its
    completion event fired); time = elapsed / iters with ``time.perf_counter()``.

Output
    One JSON object per line: impl ("torch-nccl"), op, world_size (1), bytes,
    time_s, iters, method ("each call waited").
"""

import argparse
import json
import time

import torch
import torch.distributed as dist


def size(text: str) -> int:
    t = text.strip().upper()
    mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(t[-1:], 1)
    return int(t[:-1] if mult > 1 else t) * mult


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sizes", default="4K,1M,64M")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--port", type=int, default=29561)
    a = p.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("torch_nccl.py: no GPU (torch.cuda.is_available() is False)")
    torch.cuda.set_device(0)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{a.port}", rank=0, world_size=1)
    for nbytes in [size(s) for s in a.sizes.split(",") if s.strip()]:
        n = max(nbytes // 4, 1)
        x = torch.ones(n, device="cuda")
        out = torch.empty(n, device="cuda")
        for op, call in [("all_reduce", lambda: dist.all_reduce(x)),
                         ("all_gather", lambda: dist.all_gather_into_tensor(out, x))]:
            for _ in range(3):
                call()
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            for _ in range(a.iters):
                call()
                torch.cuda.synchronize()
            dt = (time.perf_counter() - t0) / a.iters
            print(json.dumps({"impl": "torch-nccl", "op": op, "world_size": 1, "bytes": n * 4,
                              "time_s": dt, "iters": a.iters, "method": "each call waited"}))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
