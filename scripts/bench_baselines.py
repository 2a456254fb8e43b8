"""Baselines and ceilings for scripts/bench.py, each run in its own process.

    python scripts/bench_baselines.py torch --sizes 784,2048,10 --batch 512 --steps 20
    python scripts/bench_baselines.py ddp --sizes ... --batch 512 --steps 20 --ranks 2
    python scripts/bench_baselines.py zmq --bytes 4000000,4000000 --steps 20
    python scripts/bench_baselines.py protocol --bytes 4000000,4000000 --steps 20
    python scripts/bench_baselines.py protocol_shm --bytes 4000000,4000000 --steps 20
    python scripts/bench_baselines.py protocol_fresh --bytes 4000000,4000000 --steps 20
    python scripts/bench_baselines.py memcpy --bytes ... --steps 20
    python scripts/bench_baselines.py matmul --m 512 --k 2048 --n 2048 --steps 20
    python scripts/bench_baselines.py transformer --style gpt2 --batch 32 --seq 128 --steps 20

Each prints one JSON line. The PyTorch rows need `pip install
torch==2.13.0` (never a dependency of the project); without it they print
{"skipped": "..."}. Same model as the project's FC-MNIST: Linear + ReLU +
dropout 0.1 per hidden layer, softmax cross-entropy, SGD with momentum 0.9,
on a fixed random batch (the input pipeline is not what is measured).
`transformer` is the torch equivalent of params.yaml's GPT-2 (causal, pre-norm,
tanh GELU, head: layer norm + decoder) or BERT (padding mask, post-norm, exact
GELU, head: dense + GELU + layer norm + decoder, loss on 15% of the tokens),
dropout 0.1 at the same sites, AdamW.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import numpy as np

WARMUP_STEPS = 2


def ints(text: str) -> list[int]:
    return [int(v) for v in text.split(",") if v]


# ---------------------------------------------------------------- PyTorch

def torch_transformer(torch, style: str, vocab: int, seq: int, d: int, layers: int, heads: int, ffn: int,
                      p: float = 0.1):
    """params.yaml's GPT-2 or BERT (cs_runtime/compiler/families.py) as a torch module: same
    layers, shapes and dropout sites; (ids, key_keep) -> logits [B, T, vocab]."""
    nn, F = torch.nn, torch.nn.functional
    gpt = style == "gpt2"
    gelu = nn.GELU(approximate="tanh" if gpt else "none")

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
            self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
            self.fc, self.out = nn.Linear(d, ffn), nn.Linear(ffn, d)

        def attention(self, x, keep):
            b, t, _ = x.shape
            q, k, v = (z.view(b, t, heads, d // heads).transpose(1, 2) for z in self.qkv(x).split(d, dim=2))
            mask = None if keep is None else keep[:, None, None, :]
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=p if self.training else 0.0,
                                               is_causal=gpt)
            return F.dropout(self.proj(y.transpose(1, 2).reshape(b, t, d)), p, self.training)

        def mlp(self, x):
            return F.dropout(self.out(gelu(self.fc(x))), p, self.training)

        def forward(self, x, keep):
            if gpt:
                x = x + self.attention(self.ln1(x), keep)
                return x + self.mlp(self.ln2(x))
            x = self.ln1(x + self.attention(x, keep))
            return self.ln2(x + self.mlp(x))

    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.tokens, self.positions = nn.Embedding(vocab, d), nn.Embedding(seq, d)
            self.embed_ln = None if gpt else nn.LayerNorm(d)
            self.blocks = nn.ModuleList(Block() for _ in range(layers))
            self.transform = None if gpt else nn.Linear(d, d)
            self.ln, self.decoder = nn.LayerNorm(d), nn.Linear(d, vocab)

        def forward(self, ids, keep):
            x = self.tokens(ids) + self.positions.weight[:ids.shape[1]]
            x = F.dropout(x if gpt else self.embed_ln(x), p, self.training)
            for block in self.blocks:
                x = block(x, keep)
            if not gpt:
                x = gelu(self.transform(x))
            return self.decoder(self.ln(x))

    return Model()


def run_transformer(args) -> dict:
    """Training steps of torch_transformer with AdamW on fixed random tokens (BERT: a padded
    tail on some samples, labels on 15% of the tokens, the rest ignored)."""
    try:
        import torch
    except ImportError:
        return {"skipped": "torch is not installed (pip install torch==2.13.0)"}
    torch.manual_seed(0)
    model = torch_transformer(torch, args.style, args.vocab, args.seq, args.hidden, args.layers, args.heads,
                              args.ffn)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)
    ids = torch.randint(4, args.vocab, (args.batch, args.seq))
    labels = torch.randint(4, args.vocab, (args.batch, args.seq))
    keep = None
    if args.style == "bert":
        keep = torch.ones(args.batch, args.seq, dtype=torch.bool)
        keep[::4, args.seq * 3 // 4:] = False                 # every fourth sample padded at the end
        labels[torch.rand(args.batch, args.seq) > 0.15] = -100

    def step():
        opt.zero_grad(set_to_none=True)
        logits = model(ids, keep)
        torch.nn.functional.cross_entropy(logits.reshape(-1, args.vocab), labels.reshape(-1),
                                          ignore_index=-100).backward()
        opt.step()

    for _ in range(WARMUP_STEPS):
        step()
    start, cpu = time.perf_counter(), time.process_time()
    for _ in range(args.steps):
        step()
    # CPU seconds too: on a shared machine they say more than the wall clock (both threads' spin included)
    return {"samples_per_sec": args.batch * args.steps / (time.perf_counter() - start),
            "cpu_s_per_step": (time.process_time() - cpu) / args.steps, "threads": torch.get_num_threads()}


def torch_model(torch, sizes: list[int]):
    layers = []
    for i, (n_in, n_out) in enumerate(zip(sizes[:-1], sizes[1:])):
        layers.append(torch.nn.Linear(n_in, n_out))
        if i < len(sizes) - 2:
            layers += [torch.nn.ReLU(), torch.nn.Dropout(0.1)]
    return torch.nn.Sequential(*layers)


def torch_steps(torch, model, batch: int, sizes: list[int], steps: int) -> float:
    """Seconds for `steps` training steps after warm-up."""
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    loss_fn = torch.nn.CrossEntropyLoss()
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(batch, sizes[0], generator=gen)
    y = torch.randint(0, sizes[-1], (batch,), generator=gen)

    def step():
        opt.zero_grad(set_to_none=True)
        loss_fn(model(x), y).backward()
        opt.step()

    for _ in range(WARMUP_STEPS):
        step()
    start = time.perf_counter()
    for _ in range(steps):
        step()
    return time.perf_counter() - start


def run_torch(args) -> dict:
    try:
        import torch
    except ImportError:
        return {"skipped": "torch is not installed (pip install torch==2.13.0)"}
    seconds = torch_steps(torch, torch_model(torch, args.sizes), args.batch, args.sizes, args.steps)
    return {"samples_per_sec": args.batch * args.steps / seconds, "threads": torch.get_num_threads()}


def ddp_rank(rank: int, args, port: int, out) -> None:
    import torch
    import torch.distributed as dist
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // args.ranks))
    dist.init_process_group("gloo", rank=rank, world_size=args.ranks)
    try:
        torch.manual_seed(0)      # every rank starts from the same weights, as DDP expects
        model = torch.nn.parallel.DistributedDataParallel(torch_model(torch, args.sizes))
        seconds = torch_steps(torch, model, args.batch // args.ranks, args.sizes, args.steps)
        if rank == 0:
            out.put(seconds)
    finally:
        dist.destroy_process_group()


def run_ddp(args) -> dict:
    try:
        import torch.multiprocessing as mp
    except ImportError:
        return {"skipped": "torch is not installed (pip install torch==2.13.0)"}
    port = free_port()
    ctx = mp.get_context("spawn")
    out = ctx.SimpleQueue()
    mp.start_processes(ddp_rank, args=(args, port, out), nprocs=args.ranks, start_method="spawn")
    seconds = out.get()
    return {"samples_per_sec": args.batch * args.steps / seconds, "ranks": args.ranks}


def free_port() -> int:
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ---------------------------------------------------------------- ceilings

# Every transport row delivers each tensor into a buffer the receiver owns (one
# np.copyto), as the memcpy row does, so all four measure the same thing:
# bytes of the sender's tensors landed in the receiver's memory per second. The
# receiver times its own steps after the warm-up (timed_steps), as the memcpy row
# does: from the sender's side the time would also hold the receiver's exit (the
# interpreter's teardown, a tenth of a second) and whatever of its warm-up was still
# queued, which the memcpy row has not.

def timed_steps(steps: int, receive_step, seconds) -> None:
    """receive_step() WARMUP_STEPS times, then `steps` times timed; the timed seconds
    put on `seconds` (a queue the sender reads)."""
    for _ in range(WARMUP_STEPS):
        receive_step()
    start = time.perf_counter()
    for _ in range(steps):
        receive_step()
    seconds.put(time.perf_counter() - start)


def zmq_receiver(address: str, sizes: list[int], steps: int, seconds) -> None:
    import zmq
    ctx = zmq.Context()
    pull = ctx.socket(zmq.PULL)
    pull.connect(address)
    own = [np.empty(n // 4, dtype=np.float32) for n in sizes]

    def receive_step() -> None:
        for buffer in own:
            np.copyto(buffer, np.frombuffer(pull.recv(copy=False).buffer, dtype=np.float32))
    timed_steps(steps, receive_step, seconds)
    ctx.destroy(linger=0)


def receive_timed(target, args: tuple, send_steps) -> float:
    """Start the receiver (a spawned process running target(*args, seconds)), run
    send_steps(), and return the seconds the receiver timed."""
    import multiprocessing
    spawn = multiprocessing.get_context("spawn")
    seconds = spawn.SimpleQueue()
    receiver = spawn.Process(target=target, args=(*args, seconds))
    receiver.start()
    try:
        send_steps()
        receiver.join()
        if receiver.exitcode != 0 or seconds.empty():
            raise SystemExit(f"bench_baselines: the receiver failed (exit {receiver.exitcode})")
        return seconds.get()
    finally:
        if receiver.is_alive():
            receiver.kill()


def run_zmq(args) -> dict:
    """PUSH -> PULL over loopback tcp, one frame per tensor, zero-copy sends, no protocol."""
    import zmq
    ctx = zmq.Context()
    push = ctx.socket(zmq.PUSH)
    push.setsockopt(zmq.LINGER, 0)
    port = push.bind_to_random_port("tcp://127.0.0.1")
    buffers = [np.ones(n // 4, dtype=np.float32) for n in args.bytes]

    def send_steps() -> None:
        for _ in range(WARMUP_STEPS + args.steps):
            for b in buffers:
                push.send(b, copy=False)
    try:
        seconds = receive_timed(zmq_receiver, (f"tcp://127.0.0.1:{port}", args.bytes, args.steps), send_steps)
    finally:
        ctx.destroy(linger=0)
    return {"bytes_per_sec": sum(args.bytes) * args.steps / seconds}


def protocol_receiver(address: str, sizes: list[int], steps: int, folder: str | None, fresh: bool,
                      seconds) -> None:
    import zmq
    from cs_runtime.wire.shm import Segments
    from cs_runtime.wire.transport import Endpoint
    ctx = zmq.Context()
    pull = Endpoint(ctx, zmq.PULL, "bench-pull", "bench").connect(address)
    if folder:
        pull.share_memory(Segments(Path(folder)))
    own = [np.empty(n // 4, dtype=np.float32) for n in sizes]

    def receive_step() -> None:
        for buffer in own:
            # decoded and validated, as a WSE does; a tensor of several frames is joined
            # straight into the kept buffer, any other (one frame, or shared memory) copied there
            _, msg = pull.recv(into=None if fresh else lambda *_header, b=buffer: b)
            got = msg.arrays["weight"]
            if fresh or not np.may_share_memory(got, buffer):
                np.copyto(buffer, got)
    timed_steps(steps, receive_step, seconds)
    ctx.destroy(linger=0)


def run_protocol(args, shared: bool = False, fresh: bool = False) -> dict:
    """The project's own path: WEIGHTS messages through Endpoint, over tcp or by shared-memory reference.
    fresh: decoded into fresh buffers, then copied to the kept ones (the receive before kept buffers)."""
    import tempfile
    import zmq
    from cs_runtime.wire.protocol import Message, Msg
    from cs_runtime.wire.shm import Arena, Segments
    from cs_runtime.wire.transport import Endpoint
    ctx = zmq.Context()
    push = Endpoint(ctx, zmq.PUSH, "bench-push", "bench")
    address = push.bind()
    folder, arena = None, None
    if shared:
        folder = tempfile.mkdtemp(prefix="cs-bench-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
        arena = Arena(Path(folder), "cs-bench-memoryx0-1", sum(args.bytes) + 64 * len(args.bytes))
        push.share_memory(Segments(Path(folder)))
        push.segments.add_arena(arena)
        layers = [{"weight": arena.copy_of(np.ones(n // 4, dtype=np.float32))} for n in args.bytes]
    else:
        layers = [{"weight": np.ones(n // 4, dtype=np.float32)} for n in args.bytes]

    def send_steps() -> None:
        for step in range(WARMUP_STEPS + args.steps):
            for index, arrays in enumerate(layers):
                push.send(Message(Msg.WEIGHTS, step=step, layer=index, meta={"phase": "fwd"}, arrays=arrays))
    try:
        seconds = receive_timed(protocol_receiver, (address, args.bytes, args.steps, folder, fresh), send_steps)
    finally:
        ctx.destroy(linger=0)
        if arena is not None:
            arena.close()
            os.rmdir(folder)
    return {"bytes_per_sec": sum(args.bytes) * args.steps / seconds}


def run_protocol_shm(args) -> dict:
    return run_protocol(args, shared=True)


def run_protocol_fresh(args) -> dict:
    return run_protocol(args, fresh=True)


def run_memcpy(args) -> dict:
    src = [np.ones(n // 4, dtype=np.float32) for n in args.bytes]
    dst = [np.empty_like(s) for s in src]
    for _ in range(WARMUP_STEPS):
        for s, d in zip(src, dst):
            np.copyto(d, s)
    start = time.perf_counter()
    for _ in range(args.steps):
        for s, d in zip(src, dst):
            np.copyto(d, s)
    return {"bytes_per_sec": sum(args.bytes) * args.steps / (time.perf_counter() - start)}


def run_matmul(args) -> dict:
    rng = np.random.default_rng(0)
    a = rng.standard_normal((args.m, args.k), dtype=np.float32)
    b = rng.standard_normal((args.k, args.n), dtype=np.float32)
    out = np.empty((args.m, args.n), dtype=np.float32)
    for _ in range(WARMUP_STEPS):
        np.matmul(a, b, out=out)
    start = time.perf_counter()
    for _ in range(args.steps):
        np.matmul(a, b, out=out)
    return {"flops_per_sec": 2 * args.m * args.k * args.n * args.steps / (time.perf_counter() - start)}


RUNS = {"torch": run_torch, "ddp": run_ddp, "zmq": run_zmq, "protocol": run_protocol,
        "protocol_shm": run_protocol_shm, "protocol_fresh": run_protocol_fresh, "memcpy": run_memcpy,
        "matmul": run_matmul, "transformer": run_transformer}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("what", choices=sorted(RUNS))
    parser.add_argument("--sizes", type=ints, default=[784, 256, 128, 10], help="layer widths, comma separated")
    parser.add_argument("--batch", type=int, default=128)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--bytes", type=ints, default=[], help="bytes per tensor of one step")
    parser.add_argument("--m", type=int, default=512)
    parser.add_argument("--k", type=int, default=2048)
    parser.add_argument("--n", type=int, default=2048)
    parser.add_argument("--style", choices=("gpt2", "bert"), default="gpt2", help="transformer: the model")
    parser.add_argument("--vocab", type=int, default=260)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--ffn", type=int, default=1024)
    args = parser.parse_args(argv)
    print(json.dumps(RUNS[args.what](args)), flush=True)


if __name__ == "__main__":
    sys.exit(main())
