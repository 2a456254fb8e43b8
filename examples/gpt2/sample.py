"""Sample text from a trained GPT-2 checkpoint (CPU, numpy, no cluster needed).

    python examples/gpt2/sample.py --model_dir model_dir --prompt "The while statement" --tokens 200
    python examples/gpt2/sample.py --checkpoint model_dir/checkpoint_300.npz --temperature 0.8 --seed 3

The model comes from the checkpoint itself (its saved model spec), so the
sampler needs no params.yaml. Each new token is drawn from the softmax of
the last position's logits / temperature (top_k: only the k likeliest);
the context is the last max_len tokens.
"""
from __future__ import annotations

import argparse
import sys

import numpy as np

from cs_runtime import checkpoint as ckpt
from cs_runtime.compiler.families import lower_spec
from cs_runtime.numerics.model import ModelSpec, ShardContext, model_forward
from cs_runtime.data.text import decode, encode


def load_model(path: str) -> tuple[ModelSpec, dict]:
    state = ckpt.load(path)
    spec = ModelSpec.from_dict(state.meta["model"])
    if not spec.token_model or not spec.layers[1].causal:
        raise ValueError(f"{path}: not a GPT (causal language model) checkpoint")
    ckpt.with_tied_copies(spec, state.weights, state.opt_state)   # a tied table is stored once
    return lower_spec(spec), state.weights   # the program every path runs


def sample(spec: ModelSpec, weights: dict, prompt: str, tokens: int, temperature: float, top_k: int,
           seed: int) -> str:
    rng = np.random.default_rng(seed)
    ids = list(encode(prompt)) or [int(encode("\n")[0])]
    max_len = spec.layers[0].max_len
    for _ in range(tokens):
        x = np.array([ids[-max_len:]], dtype=np.int32)
        # The program ends in its loss: any labels do; the logits are [tokens, vocabulary].
        ctx = ShardContext(seed, 0, 1, slice(0, 1), train=False, labels=np.zeros_like(x))
        live = model_forward(spec, x, weights, ctx)[0]
        logits = live[spec.program["logits"]][-1].astype(np.float64)
        if top_k:
            logits[np.argsort(logits)[:-top_k]] = -np.inf
        p = np.exp((logits - logits.max()) / max(temperature, 1e-6))
        ids.append(int(rng.choice(len(p), p=p / p.sum())))
    return decode(ids)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Sample text from a GPT-2 checkpoint.")
    where = parser.add_mutually_exclusive_group(required=True)
    where.add_argument("--model_dir", help="use the latest checkpoint in this folder")
    where.add_argument("--checkpoint", help="a checkpoint_<step>.npz file")
    parser.add_argument("--prompt", default="The ")
    parser.add_argument("--tokens", type=int, default=200, help="how many tokens (bytes) to generate")
    parser.add_argument("--temperature", type=float, default=0.8)
    parser.add_argument("--top_k", type=int, default=0, help="0: sample from the whole vocabulary")
    parser.add_argument("--seed", type=int, default=1)
    a = parser.parse_args(argv)
    path = a.checkpoint or ckpt.latest(a.model_dir)
    if path is None:
        print(f"error: no checkpoint in {a.model_dir}", file=sys.stderr)
        return 1
    try:
        spec, weights = load_model(str(path))
    except (ValueError, OSError, KeyError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    print(sample(spec, weights, a.prompt, a.tokens, a.temperature, a.top_k, a.seed))
    return 0


if __name__ == "__main__":
    sys.exit(main())
