"""A plain PyTorch BERT-style encoder (model.py) whose forward takes three
tensors, input_ids, attention_mask and token_type_ids, pre-trained with the
masked-LM objective on the emulated CS system.

    csrun_cpu python examples/torch_bert/run.py --mode train --params examples/torch_bert/configs/params.yaml
    csrun_wse python examples/torch_bert/run.py --mode train --params examples/torch_bert/configs/params.yaml

model_fn captures the module with an example batch given as a dict by
forward()'s argument names; the input function's data set hands out its
features as a dict by the same names, and the input workers stream each as
its own array. Samples are examples/bert's ([CLS] lines [SEP] [PAD]...,
static masking); token_type_ids mark the second half of each sample's text
as segment 1, as a sentence pair would. Dropout (model.dropout_rate,
attention_dropout_rate) draws its masks from (seed, step, sample), so every
path drops the same units.
"""
import sys
from pathlib import Path

import numpy as np
import torch

from cs_runtime.data.text import PAD, BertDataset, load_corpus
from cs_runtime.runner import run
from cs_torch.capture import model_spec
if not __package__:  # run as a script (python examples/...): its sibling module is found from the repo root
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from examples.torch_bert.model import Bert, BertConfig, mlm_loss


def seq_len(params, section) -> int:
    return section.max_sequence_length or params.model.max_position_embeddings


def build_module(params) -> Bert:
    m = params.model
    torch.manual_seed(params.runconfig.seed)
    return Bert(BertConfig(vocab_size=m.vocab_size, max_len=m.max_position_embeddings, n_layer=m.num_hidden_layers,
                           n_head=m.num_heads, n_embd=m.hidden_size, ffn=m.filter_size or 4 * m.hidden_size,
                           dropout=m.dropout_rate or 0.0, attn_dropout=m.attention_dropout_rate or 0.0))


def example_batch(batch: int, t: int) -> dict:
    zeros = torch.zeros(batch, t, dtype=torch.long)
    return {"input_ids": zeros, "attention_mask": torch.ones(batch, t, dtype=torch.long), "token_type_ids": zeros}


def model_fn(params):
    batch, t = params.train_input.batch_size, seq_len(params, params.train_input)
    labels = torch.zeros(batch, t, dtype=torch.long)
    return model_spec("torch_bert", build_module(params), example_batch(batch, t), labels, mlm_loss)


class Features:
    """examples/bert's masked-LM samples, as the three arrays the model takes."""

    def __init__(self, samples: BertDataset):
        self.samples = samples

    def __len__(self) -> int:
        return len(self.samples)

    def get(self, indices):
        ids, labels = self.samples.get(indices)
        mask = (ids != PAD).astype(np.int32)
        half = mask.sum(axis=1, keepdims=True) // 2
        types = ((np.arange(ids.shape[1])[None, :] >= half) & (mask == 1)).astype(np.int32)
        return {"input_ids": ids, "attention_mask": mask, "token_type_ids": types}, labels


def _input_fn(params, section, split):
    samples = BertDataset(load_corpus(section.data_dir, split), seq_len(params, section), section.masked_lm_prob,
                          params.runconfig.seed)
    return Features(samples)


def train_input_fn(params):
    return _input_fn(params, params.train_input, "train")


def eval_input_fn(params):
    return _input_fn(params, params.eval_input, "eval")


if __name__ == "__main__":
    run(model_fn, train_input_fn, eval_input_fn)
