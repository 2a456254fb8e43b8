"""run.py of tests/torch_models.ViewAttention (heads by view(B, T, -1, head_dim), token
types from a buffer expanded to the batch, Gaussian noise on the embeddings by
torch.randn_like) on the byte corpus, for the cluster test that runs it on shards
(tests/test_torch_shards.py)."""
import sys
from pathlib import Path

import torch

if not __package__:  # run as a script: the tests package is found from the repo root
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from cs_runtime.data.text import GptDataset, load_corpus  # noqa: E402
from cs_runtime.runner import run  # noqa: E402
from cs_torch.capture import model_spec  # noqa: E402
from tests.torch_models import ViewAttention, token_loss  # noqa: E402


def model_fn(params):
    torch.manual_seed(params.runconfig.seed)
    t = params.train_input.max_sequence_length
    module = ViewAttention(vocab=params.model.vocab_size, d=params.model.hidden_size, head_dim=8, max_len=t,
                           noise=0.1)
    ids = torch.zeros(params.train_input.batch_size, t, dtype=torch.long)
    return model_spec("view_attention", module, (ids,), ids, token_loss)


def train_input_fn(params):
    return GptDataset(load_corpus(params.train_input.data_dir, "train"), params.train_input.max_sequence_length)


if __name__ == "__main__":
    run(model_fn, train_input_fn, train_input_fn)
