"""The project's single-file GPT-2 (model.py, plain PyTorch) trained on the
emulated CS system: the module is captured with an example batch and its
loss, compiled into weight-streaming units, and run by every path.

    csrun_cpu python examples/torch_gpt/run.py --mode train --params examples/torch_gpt/configs/params.yaml
    csrun_wse python examples/torch_gpt/run.py --mode train --params examples/torch_gpt/configs/params.yaml
    csrun_cpu python examples/torch_gpt/run.py --mode train --params ... --compile_only   # the unit report

The starting weights are the module's own (GPT-2 init under torch.manual_seed(runconfig.seed));
the output head is tied to the token embedding.
"""
import sys
from pathlib import Path

import torch

from cs_runtime.data.text import GptDataset, load_corpus
from cs_runtime.runner import run
from cs_torch.capture import model_spec
if not __package__:  # run as a script (python examples/...): its sibling module is found from the repo root
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from examples.torch_gpt.model import GPT, GPTConfig, gpt_loss


def seq_len(params, section) -> int:
    return section.max_sequence_length or params.model.max_position_embeddings


def build_module(params) -> GPT:
    m = params.model
    if (m.loss_scaling, m.loss_weight) != ("num_tokens", 1.0):
        raise ValueError("examples/torch_gpt: model.loss_scaling must be num_tokens and loss_weight 1 (gpt_loss is "
                         "the mean over tokens); examples/gpt2 takes the model zoo's batch_size scaling")
    if m.attention_dropout_rate:
        raise ValueError("examples/torch_gpt: model.attention_dropout_rate must be 0 (this GPT's attention is "
                         "F.scaled_dot_product_attention without dropout; dropout_rate drops the residuals)")
    torch.manual_seed(params.runconfig.seed)
    return GPT(GPTConfig(vocab_size=m.vocab_size, block_size=m.max_position_embeddings, n_layer=m.num_hidden_layers,
                         n_head=m.num_heads, n_embd=m.hidden_size, dropout=m.dropout_rate or 0.0))


def model_fn(params):
    module = build_module(params)
    batch, t = params.train_input.batch_size, seq_len(params, params.train_input)
    ids = torch.zeros(batch, t, dtype=torch.long)
    return model_spec("torch_gpt", module, (ids,), ids, gpt_loss)


def train_input_fn(params):
    return GptDataset(load_corpus(params.train_input.data_dir, "train"), seq_len(params, params.train_input))


def eval_input_fn(params):
    return GptDataset(load_corpus(params.eval_input.data_dir, "eval"), seq_len(params, params.eval_input))


if __name__ == "__main__":
    run(model_fn, train_input_fn, eval_input_fn)
