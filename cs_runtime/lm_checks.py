"""What the language-model examples (examples/gpt2, examples/bert) check in the
params before they build a model: every model-zoo setting the emulated model
cannot honour is one line, all of them at once (`ParamsError`), so no key is
accepted and then ignored.

    problems = language_model_problems(params, "gpt2")   # [] or ["model.use_bias_in_output: ...", ...]
"""
from __future__ import annotations

from cs_runtime.config import MODEL_CONFIGS, Params, ParamsError

# The model zoo's data processors of each model (train_input.data_processor):
# the example's input function reads the data of any of them from data_dir.
DATA_PROCESSORS = {
    "gpt2": ("GptHDF5DataProcessor", "GptHDF5MapDataProcessor", "GptTextDataProcessor"),
    "bert": ("BertCSVDynamicMaskDataProcessor", "BertCSVDataProcessor", "BertHDF5DataProcessor"),
}


def seq_len(params: Params, section) -> int:
    return section.max_sequence_length or params.model.max_position_embeddings


def language_model_problems(params: Params, model: str) -> list[str]:
    """One line per setting the emulated GPT-2 / BERT cannot honour."""
    m = params.model
    if not isinstance(m, MODEL_CONFIGS[model]):
        return [f"model: this script builds {model}, but the params were read as a {type(m).__name__} section "
                f"(say model: {{name: {model}}}, or run the {model} example)"]
    problems = []
    if model == "bert" and m.use_bias_in_output is not None:
        problems.append("model.use_bias_in_output: is GPT-2's key; the model zoo's BERT names its masked-LM "
                        "decoder's bias use_output_bias_in_mlm")
    if model == "bert" and m.mlm_loss_scaling != "batch_size" and m.mlm_loss_weight is not None \
            and not params.train_input.dynamic_mlm_scale:
        problems.append(f"model.mlm_loss_weight: applies with mlm_loss_scaling: batch_size only; with "
                        f"{m.mlm_loss_scaling} the loss is the mean over the masked tokens; remove one of them")
    if model == "bert" and m.disable_nsp is True and m.num_segments is not None:
        problems.append("model.num_segments: segment embeddings come with the next-sentence head here; with "
                        "disable_nsp: true leave num_segments out")
    for name in ("train_input", "eval_input"):
        section = getattr(params, name)
        if seq_len(params, section) > m.max_position_embeddings:
            problems.append(f"{name}.max_sequence_length {section.max_sequence_length} exceeds "
                            f"model.max_position_embeddings {m.max_position_embeddings}")
        processor = section.data_processor
        if processor is not None and processor not in DATA_PROCESSORS[model]:
            problems.append(f"{name}.data_processor: {processor} is not a {model} data processor "
                            f"(one of {', '.join(DATA_PROCESSORS[model])})")
        if model == "gpt2" and section.max_predictions_per_seq is not None:
            problems.append(f"{name}.max_predictions_per_seq: is for BERT's masked-LM data")
        if model == "gpt2" and section.dynamic_mlm_scale is not None:
            problems.append(f"{name}.dynamic_mlm_scale: is for BERT's masked-LM loss")
    if model == "bert" and m.mlm_loss_scaling != "batch_size" and params.train_input.dynamic_mlm_scale:
        problems.append(f"train_input.dynamic_mlm_scale: is the mean over the masked tokens, as "
                        f"mlm_loss_scaling: {m.mlm_loss_scaling} already says; give one of them")
    return problems


def head_options(params: Params, model: str) -> dict:
    """The output head as the model zoo builds it: tied to the token embedding unless
    share_embedding_weights: false (its default is true for both models); GPT-2's decoder
    has a bias only with use_bias_in_output: true (its default false), BERT's unless
    use_output_bias_in_mlm: false."""
    m = params.model
    tied = True if m.share_embedding_weights is None else bool(m.share_embedding_weights)
    out_bias = bool(m.use_bias_in_output) if model == "gpt2" else m.use_output_bias_in_mlm is not False
    return {"tied": tied, "out_bias": out_bias}


def nsp_options(params: Params) -> dict:
    """BERT's next-sentence head as the model zoo builds it unless disable_nsp: true:
    num_segments segment embeddings (default 2) and a pooler with pooler_nonlinearity (tanh)."""
    m = params.model
    if m.disable_nsp is True:
        return {"nsp": False}
    return {"nsp": True, "num_segments": m.num_segments or 2, "pooler_activation": m.pooler_nonlinearity or "tanh"}


def mlm_loss_scaling(params: Params) -> str:
    """BERT's masked-LM normaliser (kernels.TOKEN_LOSS_SCALINGS): batch_size (the PyTorch
    model zoo's BertPretrainModelLoss, times mlm_loss_weight), or num_masked /
    precomputed_num_masked: the mean over the global batch's masked tokens (the second is
    the same number, which the model zoo's data loader factorises for 16-bit safety).
    1.x's train_input.dynamic_mlm_scale: true is num_masked too: its data loader scales the
    loss by batch_size / masked tokens, and mlm_loss_weight is then left unused."""
    if params.train_input.dynamic_mlm_scale:
        return "num_masked"
    return params.model.mlm_loss_scaling


def mlm_loss_weight(params: Params) -> float:
    """BERT's masked-LM loss factor, as the model zoo's BertPretrainModelLoss applies it:
    loss = mlm_loss_weight * sum over masked tokens of their cross-entropy / batch_size."""
    weight = params.model.mlm_loss_weight
    return 1.0 if weight is None or params.train_input.dynamic_mlm_scale else float(weight)


def gpt2_loss(params: Params) -> dict:
    """GPT-2's loss as the model zoo's GPTLMHeadModelLoss: the mean over predicted tokens
    (num_tokens), or their sum * loss_weight / batch_size (batch_size); a loss_weight other
    than 1 with num_tokens is batch_size, the model zoo's own fallback."""
    m = params.model
    scaling = "batch_size" if m.loss_weight != 1.0 else m.loss_scaling
    return {"loss_scaling": scaling, "loss_weight": m.loss_weight if scaling == "batch_size" else 1.0}


def check_language_model(params: Params, model: str) -> None:
    problems = language_model_problems(params, model)
    if problems:
        raise ParamsError(problems)
