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
    if m.share_embedding_weights:
        problems.append("model.share_embedding_weights: true (a tied token embedding and output head) is not "
                        "emulated yet; set it to false")
    if m.use_bias_in_output is False:
        problems.append("model.use_bias_in_output: false (an output layer without bias) is not emulated; "
                        "set it to true")
    if model == "bert" and m.disable_nsp is not True:
        problems.append("model.disable_nsp: the model zoo's BERT also learns next-sentence prediction unless "
                        "disable_nsp: true; that head is not emulated, so set disable_nsp: true")
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
    return problems


def mlm_loss_weight(params: Params) -> float:
    """BERT's masked-LM loss factor, as the model zoo's BertPretrainModelLoss applies it:
    loss = mlm_loss_weight * sum over masked tokens of their cross-entropy / batch_size."""
    weight = params.model.mlm_loss_weight
    return 1.0 if weight is None else float(weight)


def check_language_model(params: Params, model: str) -> None:
    problems = language_model_problems(params, model)
    if problems:
        raise ParamsError(problems)
