"""GPT-2 style decoder-only language model, model-zoo style.

    csrun_cpu python examples/gpt2/run.py --mode train_and_eval --params examples/gpt2/configs/params.yaml
    csrun_wse python examples/gpt2/run.py --mode train_and_eval --params examples/gpt2/configs/params.yaml
    python examples/gpt2/sample.py --model_dir model_dir --prompt "The for statement"

Trains next-token prediction on the Python reference text that ships with
Python (pydoc_data.topics), byte-level tokens (cs_runtime/data/text.py); with
train_input.data_dir, on the model zoo's preprocessed *.h5 files there
(cs_runtime/data/hdf5.py, h5py), else the *.txt or pre-tokenised *.npy files.
The head's decoder is the token embedding, transposed, without a bias, as the
model zoo's GPT-2 (share_embedding_weights, use_bias_in_output).
Eval reports the mean loss per token (perplexity = exp(loss)).
"""
from cs_runtime.data.hdf5 import GptHdf5Dataset, h5_files
from cs_runtime.data.text import GptDataset, load_corpus
from cs_runtime.lm_checks import check_language_model, gpt2_loss, head_options, seq_len
from cs_runtime.numerics.model import transformer_spec
from cs_runtime.runner import run


def model_fn(params):
    m = params.model
    check_language_model(params, "gpt2")
    return transformer_spec("gpt2", style="gpt2", vocab_size=m.vocab_size, max_len=m.max_position_embeddings,
                            hidden_size=m.hidden_size, num_layers=m.num_hidden_layers, num_heads=m.num_heads,
                            ffn_features=m.filter_size, dropout=m.dropout_rate,
                            attn_dropout=m.attention_dropout_rate, eps=m.layer_norm_epsilon,
                            **head_options(params, "gpt2"), **gpt2_loss(params))


def dataset(params, section, split: str):
    if h5_files(section.data_dir):   # the model zoo's preprocessed files (GptHDF5DataProcessor)
        return GptHdf5Dataset(section.data_dir, seq_len(params, section), params.model.vocab_size)
    tokens = load_corpus(section.data_dir, split, params.model.vocab_size, section.do_lower)
    return GptDataset(tokens, seq_len(params, section))


def train_input_fn(params):
    return dataset(params, params.train_input, "train")


def eval_input_fn(params):
    return dataset(params, params.eval_input, "eval")


if __name__ == "__main__":
    run(model_fn, train_input_fn, eval_input_fn, model="gpt2")
