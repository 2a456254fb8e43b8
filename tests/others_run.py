"""A run.py of the models written by others (tests/other_models.py), the model named
first on the command line:

    csrun_wse python tests/others_run.py vit --mode train --params params.yaml --model_dir m

Each is captured as its package ships it, from seed 0's weights, on its own batches
(seed 3, `runconfig.max_steps` of them, in order). Only the processes that capture (the
chief, csrun_wse's check) import torch and the model's package; an input worker streams
the batches with numpy alone."""
import sys
from pathlib import Path

import numpy as np

if not __package__:  # run as a script: the repository root holds tests/ and examples/
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from cs_runtime.runner import run  # noqa: E402
from tests import other_batches  # noqa: E402


def the_batches(kind, params):
    return other_batches.BATCHES[kind](np.random.default_rng(3), params.runconfig.max_steps)


def model_fn(kind, params):
    """The model captured on its first batch (once per process: tests/test_torch_others.py runs
    this command line in-process, for --validate_only and --compile_only in turn)."""
    from tests import other_models   # torch: only where the model is captured
    return other_models.captured(kind)[3]


def main(argv):
    if len(argv) < 2 or argv[1] not in other_batches.BATCHES:
        print(f"error: the first argument names the model, one of {sorted(other_batches.BATCHES)}", file=sys.stderr)
        sys.exit(2)
    kind = argv.pop(1)
    run(lambda params: model_fn(kind, params),
        lambda params: other_batches.as_dataset(the_batches(kind, params)), argv=argv[1:])


if __name__ == "__main__":
    main(sys.argv)
