"""The compiler's estimate beside throughputs measured on real Cerebras systems.

    python scripts/published_estimates.py          # the table in docs/estimates.md

Each row is a model zoo configuration whose training rate was published (the source is
named), rebuilt here with the emulator's transformer at the same sizes, compiled in the
mode the real run used (weight streaming: the appliance's mode) for the system it ran on,
with Adam(W) state and 16-bit streamed tensors (the model zoo's mixed precision). Nothing is run: the table is the compile's estimate and the published
figure, and their ratio.
"""
from __future__ import annotations

import argparse
from dataclasses import dataclass

from cs_runtime.compiler.families import lower_spec
from cs_runtime.compiler.planner import Target, make_plan
from cs_runtime.config import params_from_dict
from cs_runtime.numerics.model import transformer_spec

ALCF_HOMEWORK = ("ALCF AI-science training series, Cerebras homework log (BERT-Large MSL128, "
                 "1 CS-2, GlobalRate at step 1000), github.com/kharelb/ai-science-training-series homework_7.md")
ALCF_GUIDE = ("ALCF user guide, Cerebras example programs (1 CS-3, Release 2.9.0), "
              "github.com/argonne-lcf/user-guides docs/ai-testbed/cerebras/example-programs.md")


@dataclass(frozen=True)
class Published:
    name: str
    style: str             # the emulator's transformer: "bert" or "gpt2"
    vocab: int
    seq: int
    hidden: int
    layers: int
    heads: int
    ffn: int
    batch: int
    device: str            # wse2 (CS-2) or wse3 (CS-3)
    measured: float        # samples/s, as published
    source: str
    differs: str           # what the emulator's model does not have


ROWS = (
    Published("BERT-Large MSL128", "bert", 30522, 128, 1024, 24, 16, 4096, 512, "wse2", 2924.54, ALCF_HOMEWORK, ""),
    Published("BERT-Large MSL128", "bert", 30522, 128, 1024, 24, 16, 4096, 2048, "wse2", 6727.92, ALCF_HOMEWORK, ""),
    Published("GPT-J 6B", "gpt2", 50400, 2048, 4096, 28, 16, 16384, 120, "wse3", 44.75, ALCF_GUIDE,
              "parallel attention and rotary embeddings drawn as GPT-2 blocks"),
    # SwiGLU's three 4096 x 11008 matrices as two of 4096 x 16512: the same weights and FLOPs.
    Published("Llama2-7B", "gpt2", 32000, 4096, 4096, 32, 32, 16512, 1024, "wse3", 31.98, ALCF_GUIDE,
              "SwiGLU as a GELU MLP of the same size, RMSNorm as layer norm; MSL 4096 assumed"),
)


def estimate(row: Published) -> dict:
    spec = transformer_spec(row.name, style=row.style, vocab_size=row.vocab, max_len=row.seq,
                            hidden_size=row.hidden, num_layers=row.layers, num_heads=row.heads,
                            ffn_features=row.ffn, dropout=0.0, attn_dropout=0.0, eps=1e-5)
    params = params_from_dict({"train_input": {"batch_size": row.batch},
                               "model": {"mixed_precision": True, "fp16_type": "cbfloat16"},
                               "optimizer": {"optimizer_type": "adamw"},
                               "runconfig": {"execution_strategy": "weight_streaming"}})
    plan = make_plan(lower_spec(spec), params, "train", Target(device=row.device))
    est = plan.estimate
    bound = "weights' stream" if (est.transmission_samples_per_s or float("inf")) < est.compute_samples_per_s \
        else "compute"
    return {"system": plan.target["system"], "estimate": est.samples_per_s, "bound": bound,
            "params": spec.num_params()}


def table() -> str:
    lines = ["| configuration | batch | system | parameters | estimated samples/s | bound by | "
             "measured samples/s (published) | measured / estimated |",
             "|---|---:|---|---:|---:|---|---:|---:|"]
    sources = []
    for row in ROWS:
        e = estimate(row)
        if row.source not in sources:
            sources.append(row.source)
        mark = sources.index(row.source) + 1
        lines.append(f"| {row.name} | {row.batch} | {e['system']} | {e['params'] / 1e6:,.0f} M | "
                     f"{e['estimate']:,.0f} | {e['bound']} | {row.measured:,.2f} [{mark}] | "
                     f"{row.measured / e['estimate']:.2f} |")
    lines += [""] + [f"[{i}] {s}" for i, s in enumerate(sources, 1)]
    lines += [""] + [f"- {row.name}: {row.differs}" for row in ROWS if row.differs]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    argparse.ArgumentParser(description=__doc__.splitlines()[0]).parse_args(argv)
    print(table(), end="")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
