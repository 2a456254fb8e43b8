"""cstorch.utils.

    data.py         DataLoader(input_fn, *args), DataExecutor, CSConfig
    data_utils.py   cstorch.utils.data.utils: Schedule (an executor's checkpoint steps), infer_batch_size
    data_sampler.py cstorch.utils.data.sampler: pad_index
    distributed_sampler.py  DistributedSampler: the real API's order for map-style data sets (torch)
    tracker.py      RateTracker: samples and their rate
    kernel.py       kernel_annotater: a kernel name for an op (a compiler hint; the op as it is)
    num_kv_groups.py  groups_annotater: attention's key/value groups (a compiler hint)
    param_filter.py cstorch.utils.utils: make_param_filter, convert_glob_to_regex (parameters by glob)
    call_once.py    call_once(): a function that runs on its first call only
    synthetic.py    SyntheticDataset: samples made from a spec (torch)
    nest.py         walking nested batches and state dicts by scope (visit_torch_tensors, recurse_spec)
    tensorboard.py  SummaryWriter and SummaryReader
    benchmark.py    benchmark_dataloader: an input function's loader timed, its batches' structures counted
"""
from . import benchmark, call_once, data, kernel, nest, num_kv_groups, tensorboard, tracker
from . import param_filter as utils   # cstorch.utils.utils (the real package's module of that name)
from .data import CSConfig, DataLoader

__all__ = ["CSConfig", "DataLoader", "SyntheticDataset", "benchmark", "call_once", "data", "kernel", "nest",
           "num_kv_groups", "tensorboard", "tracker", "utils"]


def __getattr__(name: str):
    if name == "SyntheticDataset":   # it needs torch: loaded when asked for
        from .synthetic import SyntheticDataset
        return SyntheticDataset
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
