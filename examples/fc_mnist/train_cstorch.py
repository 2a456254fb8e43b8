"""FC-MNIST with a training loop of your own (cs_torch), on the emulated CS system.

    python examples/fc_mnist/train_cstorch.py                       # 200 steps on a local CS system, then eval
    python examples/fc_mnist/train_cstorch.py --num_csx 2 --steps 50
    python examples/fc_mnist/train_cstorch.py --cs_ip localhost:9000 # a running CS system

The defaults are examples/fc_mnist/configs/params.yaml's, so the numbers are
those of `csrun_cpu python examples/fc_mnist/run.py --mode train_and_eval
--params examples/fc_mnist/configs/params.yaml`. The input functions are
at the top level and the loop under `if __name__ == "__main__":`: the input
workers import this file to build the batches, and must not run the loop.
"""
import argparse

import cs_torch as cstorch
from cs_runtime.data.mnist import load_mnist
from cs_runtime.numerics.model import mlp_spec


def train_input_fn(data_dir=None):
    return load_mnist(data_dir, "train")


def eval_input_fn(data_dir=None):
    return load_mnist(data_dir, "test")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cs_ip", default=None, help="HOST:PORT of a running CS system (default: start one here)")
    p.add_argument("--num_csx", type=int, default=1)
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--batch_size", type=int, default=128)
    p.add_argument("--hidden", type=int, nargs="+", default=[256, 128])
    p.add_argument("--dropout", type=float, default=0.1)
    p.add_argument("--lr", type=float, default=0.02)
    p.add_argument("--momentum", type=float, default=0.9)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--log_steps", type=int, default=20)
    p.add_argument("--data_dir", default=None, help="MNIST IDX files (default: the embedded digits)")
    p.add_argument("--model_dir", default="model_dir/fc_cstorch")
    p.add_argument("--no_eval", action="store_true")
    return p.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    cstorch.initialize(cs_ip=args.cs_ip, num_csx=args.num_csx)
    cstorch.manual_seed(args.seed)
    model = cstorch.module(mlp_spec("fc_mnist", [784, *args.hidden, 10], "relu", args.dropout))
    # The same model, PyTorch-style:
    #   cstorch.nn.Sequential(cstorch.nn.Linear(784, 256), cstorch.nn.ReLU(), cstorch.nn.Dropout(0.1),
    #                         cstorch.nn.Linear(256, 128), cstorch.nn.ReLU(), cstorch.nn.Dropout(0.1),
    #                         cstorch.nn.Linear(128, 10))
    loss_fn = cstorch.nn.CrossEntropyLoss()

    loader = cstorch.dataloader(train_input_fn, args.batch_size, args.data_dir, num_steps=args.steps)
    optimizer = cstorch.optim.SGD(lr=args.lr, momentum=args.momentum)
    with cstorch.Session(model, optimizer, loss_fn, mode="train", model_dir=args.model_dir) as session:
        for step, batch in enumerate(loader, start=1):
            loss = session.step(batch)            # one weight-streaming step on the CS system
            if step % args.log_steps == 0 or step == args.steps:
                print(f"step {session.global_step}: loss {loss:.5f} "
                      f"({session.samples_per_sec:.1f} samples/sec)", flush=True)
        # Leaving the block saves the final checkpoint; session.save_checkpoint() saves one any time.

    if args.no_eval:
        return
    eval_loader = cstorch.dataloader(eval_input_fn, 128, args.data_dir, shuffle=False, drop_last=False)
    with cstorch.Session(model, None, loss_fn, mode="eval", model_dir=args.model_dir) as session:
        for batch in eval_loader:                 # one pass; weights from the latest checkpoint
            session.step(batch)
        print(f"eval: loss {session.metrics['loss']:.5f}, accuracy {session.metrics['accuracy']:.4f}")


if __name__ == "__main__":
    main()
