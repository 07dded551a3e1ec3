"""Reference benchmark of PyTorch's own Gloo collectives, in the style of nccl-tests.

What it is
    Starts ``--world-size`` local processes (one per rank, via
    ``torch.multiprocessing.spawn``) that join a ``torch.distributed`` process
    group with the "gloo" backend over loopback TCP (``tcp://127.0.0.1:PORT``),
    then times all_reduce, broadcast, all_gather and reduce_scatter on float32
    CPU tensors of the requested sizes.  Its output is meant to be printed side
    by side with shardlab's own Rust benchmark, so the columns/fields match.

How to run (from the repository root)
    .venv/bin/python benches/gloo_collectives.py --world-size 2 \
        --ops all_reduce,broadcast --sizes 4K,16M --json
    .venv/bin/python benches/gloo_collectives.py --world-size 4 --ops all_reduce --sizes 16M

Method (``--method``, the same two as shardlab's ``collectives`` bin)
    Each rank, for each op and size: allocates its tensors once, checks the
    op's result once on small rank-dependent data, then
      nccl-tests (default)  runs ``--warmup`` iterations (at least one), then
                            ``dist.barrier()`` and N iterations back to back
                            with nothing between them, timed as one block
                            with ``time.perf_counter()``; the rank's time is
                            elapsed / N.
      barrier               runs ``--warmup`` iterations (at least one), then
                            times every iteration individually:
                            ``dist.barrier()`` first so the ranks start together,
                            then ``time.perf_counter()`` around the collective
                            call only; the rank's time is the median.
    The reported ``time_s`` is the largest of the ranks' times (all_reduce MAX
    on a float64 tensor), and ``method`` says which method took it.  Rank 0
    prints.  With the default ``--iters auto`` the iteration count is chosen
    from the warm-up (timed the same way, slowest rank) so that the timed
    iterations take about 0.3 s in total, clamped to [5, 200].

Sizes and bytes (``--sizes`` takes K/M/G = KiB/MiB/GiB; dtype is always float32)
    all_reduce      tensor of ``bytes`` bytes, ReduceOp.SUM
    broadcast       tensor of ``bytes`` bytes from root 0
    all_gather      ``dist.all_gather_into_tensor(out, inp)``; ``out`` holds
                    ``bytes`` bytes in total, ``inp`` = out / world_size
    reduce_scatter  ``dist.reduce_scatter_tensor(out, inp)``; ``inp`` holds
                    ``bytes`` bytes, ``out`` = inp / world_size
    For all_gather and reduce_scatter the element count is rounded down to a
    multiple of world_size and the reported ``bytes`` is the actual full
    (gathered / scattered) size.  The timed tensors are zero-filled so that
    repeated SUMs cannot overflow to inf.

Fallbacks
    If this PyTorch's Gloo backend rejects ``all_gather_into_tensor`` or
    ``reduce_scatter_tensor``, the closest list-based call is used instead
    (``dist.all_gather(list_of_chunks, inp)`` whose chunks are views into one
    output tensor, or ``dist.reduce_scatter(out, list_of_chunks)``); if Gloo
    has no reduce_scatter at all, ``all_reduce`` of the full input followed by
    taking this rank's chunk is used.  The call actually used is reported in
    the ``call`` field.  Note that PyTorch's Gloo backend has no reduce-scatter
    algorithm: ``reduce_scatter_tensor`` itself clones the input, all-reduces
    the whole of it and copies out this rank's chunk
    (``ProcessGroupGloo::reduce_scatter_tensor_coalesced``), and the list-based
    ``reduce_scatter`` is not supported, so every reduce_scatter figure here is
    an all-reduce of the full input.  The choice is made once per op by a small probe whose
    outcome all ranks agree on.

Output
    ``--json``: one JSON object per line with fields impl ("gloo"), op, algo
    ("gloo"), world_size, bytes, time_s, algbw_GBps (= bytes / time_s /
    1e9), busbw_GBps (algbw x 2(n-1)/n for all_reduce, x (n-1)/n for
    all_gather and reduce_scatter, x 1 for broadcast), iters, method, call,
    plus dtype, threads and transport (always "tcp": Gloo's data path).  Without ``--json``: an aligned table with the same
    columns.

Robustness
    A failing rank makes the launcher terminate the others, print the error
    and exit with status 1.  The process group is created with a timeout
    (``--timeout``, default 60 s; Gloo also applies it to every collective) so
    nothing hangs forever, and is destroyed at the end.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import socket
import statistics
import sys
import time
import traceback
import warnings

# torch warns at import time when numpy is absent; irrelevant here.
warnings.filterwarnings("ignore", message=".*Failed to initialize NumPy.*")

try:
    import torch
    import torch.distributed as dist
    import torch.multiprocessing as mp
except Exception as exc:  # pragma: no cover - environment problem
    print(f"error: cannot import torch ({exc}); run with the project's .venv/bin/python", file=sys.stderr)
    sys.exit(2)

ALL_OPS = ("all_reduce", "broadcast", "all_gather", "reduce_scatter")
DEFAULT_SIZES = "4K,64K,1M,16M,64M"
DTYPE = torch.float32
ELEM = 4  # bytes per float32
TARGET_MEASURE_S = 0.3
MIN_ITERS = 5
MAX_ITERS = 200
METHODS = ("nccl-tests", "barrier")
COLUMNS = ("impl", "op", "algo", "world_size", "bytes", "time_s",
           "algbw_GBps", "busbw_GBps", "iters", "method", "call")


# --------------------------------------------------------------------------- CLI

def parse_size(text: str) -> int:
    s = text.strip().upper()
    for suffix in ("IB", "B"):
        if s.endswith(suffix) and len(s) > len(suffix) and s[-len(suffix) - 1] in "KMG":
            s = s[: -len(suffix)]
            break
    mult = 1
    if s and s[-1] in "KMG":
        mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}[s[-1]]
        s = s[:-1]
    try:
        value = int(s)
    except ValueError:
        raise argparse.ArgumentTypeError(f"bad size {text!r} (expected e.g. 4K, 16M, 1G, 4096)")
    if value <= 0:
        raise argparse.ArgumentTypeError(f"size must be positive: {text!r}")
    return value * mult


def parse_sizes(text: str) -> list[int]:
    return [parse_size(t) for t in text.split(",") if t.strip()]


def parse_ops(text: str) -> list[str]:
    ops = [t.strip() for t in text.split(",") if t.strip()]
    bad = [o for o in ops if o not in ALL_OPS]
    if bad or not ops:
        raise argparse.ArgumentTypeError(f"unknown op(s) {bad}; choose from {','.join(ALL_OPS)}")
    return ops


def parse_iters(text: str):
    if text.strip().lower() in ("auto", "adaptive", "0"):
        return None
    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"--iters must be a positive integer or 'auto', got {text!r}")
    if n < 1:
        raise argparse.ArgumentTypeError("--iters must be >= 1")
    return n


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        description="Benchmark torch.distributed Gloo collectives over loopback TCP (nccl-tests style).")
    p.add_argument("--world-size", type=int, default=2, help="number of ranks/processes (default 2)")
    p.add_argument("--ops", type=parse_ops, default=list(ALL_OPS),
                   help="comma list of " + ",".join(ALL_OPS) + " (default all)")
    p.add_argument("--sizes", type=parse_sizes, default=parse_sizes(DEFAULT_SIZES),
                   help=f"comma list of sizes, K/M/G = KiB/MiB/GiB (default {DEFAULT_SIZES})")
    p.add_argument("--iters", type=parse_iters, default=None,
                   help=f"timed iterations per measurement; default 'auto' = ~{TARGET_MEASURE_S}s "
                        f"worth, clamped to [{MIN_ITERS}, {MAX_ITERS}]")
    p.add_argument("--warmup", type=int, default=3,
                   help="untimed warm-up iterations, at least one is run (default 3)")
    p.add_argument("--method", choices=METHODS, default="nccl-tests",
                   help="nccl-tests: iterations back to back, elapsed/N per rank (default); "
                        "barrier: barrier before each iteration, median per rank; "
                        "either way the slowest rank is reported")
    p.add_argument("--threads", type=int, default=1, help="intra-op threads per rank (default 1)")
    p.add_argument("--port", type=int, default=0, help="TCP port for rendezvous (default: a free one)")
    p.add_argument("--timeout", type=float, default=60.0,
                   help="process-group timeout in seconds, also per collective (default 60)")
    p.add_argument("--json", action="store_true", help="one JSON object per line instead of a table")
    return p


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# --------------------------------------------------------------------------- ops

class Case:
    """Tensors and the callable for one (op, size) measurement on one rank."""

    def __init__(self, op: str, call: str, fn, nbytes: int, check):
        self.op, self.call, self.fn, self.nbytes, self.check = op, call, fn, nbytes, check


def make_case(op: str, call: str, size_bytes: int, rank: int, ws: int, fill=None) -> Case:
    """Build tensors for ``op`` implemented with ``call``.

    ``fill(rank, numel)`` gives initial data (default zeros); ``check`` verifies
    the result for the rank-dependent test fill used by the probe.
    """
    if op in ("all_reduce", "broadcast"):
        n = max(size_bytes // ELEM, 1)
        t = fill(rank, n) if fill else torch.zeros(n, dtype=DTYPE)
        if op == "all_reduce":
            fn = lambda: dist.all_reduce(t, op=dist.ReduceOp.SUM)
            def check():
                return torch.equal(t, sum(test_fill(r, n) for r in range(ws)))
        else:
            fn = lambda: dist.broadcast(t, src=0)
            def check():
                return torch.equal(t, test_fill(0, n))
        return Case(op, call, fn, n * ELEM, check)

    per = max(size_bytes // ELEM // ws, 1)  # elements per rank chunk, rounded down
    total = per * ws
    if op == "all_gather":
        inp = fill(rank, per) if fill else torch.zeros(per, dtype=DTYPE)
        out = torch.empty(total, dtype=DTYPE)
        if call == "all_gather_into_tensor":
            fn = lambda: dist.all_gather_into_tensor(out, inp)
        elif call == "all_gather":
            chunks = list(out.chunk(ws))  # views into `out`, written in place
            fn = lambda: dist.all_gather(chunks, inp)
        else:
            raise ValueError(call)
        def check():
            return torch.equal(out, torch.cat([test_fill(r, per) for r in range(ws)]))
        return Case(op, call, fn, total * ELEM, check)

    if op == "reduce_scatter":
        inp = fill(rank, total) if fill else torch.zeros(total, dtype=DTYPE)
        out = torch.empty(per, dtype=DTYPE)
        if call == "reduce_scatter_tensor":
            fn = lambda: dist.reduce_scatter_tensor(out, inp, op=dist.ReduceOp.SUM)
        elif call == "reduce_scatter":
            chunks = list(inp.chunk(ws))
            fn = lambda: dist.reduce_scatter(out, chunks, op=dist.ReduceOp.SUM)
        elif call == "all_reduce+slice":
            work = torch.empty_like(inp)
            def fn():
                work.copy_(inp)
                dist.all_reduce(work, op=dist.ReduceOp.SUM)
                out.copy_(work[rank * per:(rank + 1) * per])
        else:
            raise ValueError(call)
        def check():
            full = sum(test_fill(r, total) for r in range(ws))
            return torch.equal(out, full[rank * per:(rank + 1) * per])
        return Case(op, call, fn, total * ELEM, check)

    raise ValueError(op)


def test_fill(rank: int, n: int) -> torch.Tensor:
    # Small integers: sums are exact in float32, and every rank/element differs.
    return (torch.arange(n, dtype=DTYPE) % 7) + 10 * (rank + 1)


CANDIDATE_CALLS = {
    "all_reduce": ["all_reduce"],
    "broadcast": ["broadcast"],
    "all_gather": ["all_gather_into_tensor", "all_gather"],
    "reduce_scatter": ["reduce_scatter_tensor", "reduce_scatter", "all_reduce+slice"],
}


def agree_all(flag: bool) -> bool:
    """True iff ``flag`` is true on every rank."""
    t = torch.tensor([0 if flag else 1], dtype=torch.int64)
    dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return int(t.item()) == 0


def choose_call(op: str, rank: int, ws: int) -> str:
    """Probe candidate calls on a small tensor; the first that works and verifies on all ranks wins."""
    errors = []
    for call in CANDIDATE_CALLS[op]:
        ok, err = True, None
        try:
            case = make_case(op, call, 64 * ws * ELEM, rank, ws, fill=test_fill)
            case.fn()
            if not case.check():
                ok, err = False, "wrong result"
        except (RuntimeError, NotImplementedError, ValueError, TypeError, AttributeError) as exc:
            ok, err = False, f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
        # A rank whose call raised locally never entered the collective, so
        # the others may be stuck in it; unsupported calls fail identically on
        # every rank (backend capability check before any communication).
        dist.barrier()
        if agree_all(ok):
            return call
        errors.append(f"{call}: {err or 'failed on another rank'}")
    raise RuntimeError(f"no working Gloo call for {op}: " + "; ".join(errors))


# --------------------------------------------------------------------------- worker

def max_over_ranks(x: float) -> float:
    t = torch.tensor([x], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t.item())


def worker(rank: int, args, port: int) -> None:
    ws = args.world_size
    if sys.platform.startswith("linux"):
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    elif sys.platform == "darwin":
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo0")
    torch.set_num_threads(args.threads)
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=ws,
        timeout=datetime.timedelta(seconds=args.timeout),
    )
    try:
        calls = {op: choose_call(op, rank, ws) for op in args.ops}
        if rank == 0 and not args.json:
            print_header()
        for op in args.ops:
            for size in args.sizes:
                row = measure(op, calls[op], size, rank, ws, args)
                if rank == 0:
                    emit(row, args.json)
        dist.barrier()
    finally:
        dist.destroy_process_group()


def timed(case: Case, k: int, method: str) -> float:
    """This rank's seconds per operation over ``k`` operations, taken as ``method`` says."""
    if method == "nccl-tests":
        dist.barrier()
        t0 = time.perf_counter()
        for _ in range(k):
            case.fn()
        return (time.perf_counter() - t0) / k
    times = []
    for _ in range(k):
        dist.barrier()
        t0 = time.perf_counter()
        case.fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def measure(op: str, call: str, size: int, rank: int, ws: int, args) -> dict:
    case = make_case(op, call, size, rank, ws)

    # Warm-up (at least one iteration, as in shardlab), timed to size the adaptive iteration count.
    warm = timed(case, max(args.warmup, 1), args.method)

    if args.iters:
        iters = args.iters
    else:
        est = max_over_ranks(warm)  # identical on every rank
        iters = math.ceil(TARGET_MEASURE_S / est) if est > 0 else MAX_ITERS
        iters = min(max(iters, MIN_ITERS), MAX_ITERS)

    time_s = max_over_ranks(timed(case, iters, args.method))
    nbytes = case.nbytes
    algbw = nbytes / time_s / 1e9
    factor = {"all_reduce": 2 * (ws - 1) / ws, "broadcast": 1.0,
              "all_gather": (ws - 1) / ws, "reduce_scatter": (ws - 1) / ws}[op]
    return {
        "impl": "gloo", "op": op, "algo": "gloo", "world_size": ws, "bytes": nbytes,
        "time_s": time_s, "algbw_GBps": algbw, "busbw_GBps": algbw * factor,
        "iters": iters, "method": args.method, "call": call, "dtype": "float32",
        "threads": args.threads, "transport": "tcp",
    }


# --------------------------------------------------------------------------- output

WIDTHS = {"impl": 5, "op": 14, "algo": 5, "world_size": 10, "bytes": 11, "time_s": 12,
          "algbw_GBps": 10, "busbw_GBps": 10, "iters": 5, "method": 10, "call": 22}
LEFT = {"impl", "op", "algo", "method", "call"}


def print_header() -> None:
    cells = [f"{c:<{WIDTHS[c]}}" if c in LEFT else f"{c:>{WIDTHS[c]}}" for c in COLUMNS]
    print("  ".join(cells).rstrip(), flush=True)


def emit(row: dict, as_json: bool) -> None:
    if as_json:
        print(json.dumps(row), flush=True)
        return
    fmt = {"time_s": "{:.6e}", "algbw_GBps": "{:.3f}", "busbw_GBps": "{:.3f}"}
    cells = []
    for c in COLUMNS:
        v = fmt.get(c, "{}").format(row[c])
        cells.append(f"{v:<{WIDTHS[c]}}" if c in LEFT else f"{v:>{WIDTHS[c]}}")
    print("  ".join(cells).rstrip(), flush=True)


# --------------------------------------------------------------------------- main

def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    if args.world_size < 1:
        print("error: --world-size must be >= 1", file=sys.stderr)
        return 2
    if args.threads < 1:
        print("error: --threads must be >= 1", file=sys.stderr)
        return 2
    if not dist.is_available() or not dist.is_gloo_available():
        print("error: this PyTorch build has no torch.distributed Gloo backend", file=sys.stderr)
        return 2
    port = args.port or free_port()
    try:
        mp.spawn(worker, args=(args, port), nprocs=args.world_size, join=True)
    except mp.ProcessRaisedException as exc:
        print(f"error: gloo benchmark failed on rank {exc.error_index}:\n{exc}", file=sys.stderr)
        return 1
    except mp.ProcessExitedException as exc:
        print(f"error: gloo benchmark rank {exc.error_index} exited abnormally "
              f"(exit code {exc.exit_code}, signal {exc.signal_name})", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("error: interrupted", file=sys.stderr)
        return 130
    except Exception as exc:
        traceback.print_exc()
        print(f"error: gloo benchmark failed: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
