"""BERT style encoder, pre-trained with the masked-LM objective, model-zoo style.

    csrun_cpu python examples/bert/run.py --mode train_and_eval --params examples/bert/configs/params.yaml
    csrun_wse python examples/bert/run.py --mode train_and_eval --params examples/bert/configs/params.yaml

Samples are [CLS] whole lines of text [SEP] padded to max_sequence_length
(padding keys are masked in every attention); masked_lm_prob of the text
tokens are chosen, 80% [MASK] / 10% random / 10% kept (cs_runtime/data/text.py).
The corpus is the Python reference text shipped with Python
(pydoc_data.topics), or the model zoo's preprocessed *.h5 files in
train_input.data_dir (cs_runtime/data/hdf5.py, h5py), else its *.txt / *.npy files.
The training loss is the model zoo's: the masked tokens' summed cross-entropy
/ batch_size * model.mlm_loss_weight (default 1.0), or with
model.mlm_loss_scaling num_masked / precomputed_num_masked their mean; plus,
unless model.disable_nsp: true, the next-sentence cross-entropy's mean over
the batch (samples are then sentence pairs with segment ids: text.py). The
head's decoder is the token embedding, transposed, unless
share_embedding_weights: false. Eval reports the mean loss and accuracy over
the masked tokens.
"""
from cs_runtime.data.hdf5 import BertHdf5Dataset, h5_files
from cs_runtime.data.text import PAD, BertDataset, load_corpus
from cs_runtime.lm_checks import (check_language_model, head_options, mlm_loss_scaling, mlm_loss_weight,
                                  nsp_options, seq_len)
from cs_runtime.numerics.model import transformer_spec
from cs_runtime.runner import run


def model_fn(params):
    m = params.model
    check_language_model(params, "bert")
    return transformer_spec("bert", style="bert", vocab_size=m.vocab_size, max_len=m.max_position_embeddings,
                            hidden_size=m.hidden_size, num_layers=m.num_hidden_layers, num_heads=m.num_heads,
                            ffn_features=m.filter_size, dropout=m.dropout_rate,
                            attn_dropout=m.attention_dropout_rate, eps=m.layer_norm_epsilon, pad_id=PAD,
                            loss_scaling=mlm_loss_scaling(params), loss_weight=mlm_loss_weight(params),
                            **head_options(params, "bert"), **nsp_options(params))


def dataset(params, section, split: str):
    nsp = nsp_options(params)
    if h5_files(section.data_dir):   # the model zoo's preprocessed, already masked files (BertHDF5DataProcessor)
        return BertHdf5Dataset(section.data_dir, seq_len(params, section), params.model.vocab_size, nsp["nsp"],
                               nsp.get("num_segments", 2))
    vocab = params.model.vocab_size
    return BertDataset(load_corpus(section.data_dir, split, vocab, section.do_lower), seq_len(params, section),
                       section.masked_lm_prob, params.runconfig.seed, section.max_predictions_per_seq, vocab,
                       nsp=nsp["nsp"])


def train_input_fn(params):
    return dataset(params, params.train_input, "train")


def eval_input_fn(params):
    return dataset(params, params.eval_input, "eval")


if __name__ == "__main__":
    run(model_fn, train_input_fn, eval_input_fn, model="bert")
