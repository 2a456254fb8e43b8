"""The run modes a model zoo run.py takes (--mode), by the names the real API gives them."""
TRAIN = "train"
EVAL = "eval"
TRAIN_AND_EVAL = "train_and_eval"
INFERENCE = "inference"
EVAL_ALL = "eval_all"


def get_modes() -> tuple[str, ...]:
    return (TRAIN, EVAL, TRAIN_AND_EVAL, INFERENCE, EVAL_ALL)


def is_valid(mode: str) -> bool:
    return mode in get_modes()
