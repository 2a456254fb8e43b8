"""The torch DataLoader's order a CSX run replays (cs_torch/loader_replay.py), against iterating the loader:
the same batches epoch after epoch, drawn one epoch at a time (no start-up cost that grows with the run,
a bounded window kept), the same in a process that replays saved states, whatever else draws meanwhile.
"""
from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="the replayed loaders are torch DataLoaders (pip install -e '.[torch]')")

from cs_torch.loader_replay import WINDOW_BATCHES, RunSamples, start_states  # noqa: E402
from cs_torch.nn import CsTorchError  # noqa: E402

DATA = torch.utils.data.TensorDataset(torch.arange(24.0).reshape(24, 1), torch.arange(24) % 3)


def torch_order(loader, epochs: int) -> list[list[int]]:
    return [[int(v) for v in x[:, 0]] for _ in range(epochs) for x, _ in loader]


def replayed(samples: RunSamples, steps: int) -> list[list[int]]:
    return [[int(v) for v in samples.get(np.arange(b * 4, b * 4 + 4))[0][:, 0]] for b in range(steps)]


@pytest.mark.parametrize("generator", [None, 3])
def test_replay_gives_torchs_batches_and_leaves_the_generators_as_iterating_would(generator):
    make = lambda: torch.utils.data.DataLoader(   # noqa: E731
        DATA, 4, shuffle=True, drop_last=True,
        generator=None if generator is None else torch.Generator().manual_seed(generator))
    torch.manual_seed(0)
    loader = make()
    want = torch_order(loader, 3)
    after = torch.rand(1)
    torch.manual_seed(0)
    loader = make()
    samples = RunSamples(loader, 18, start_states(loader))
    got = []
    for b in range(18):
        got.append([int(v) for v in samples.batch(b)])
        torch.rand(5)                        # the user's own draws between steps change no batch
    assert got == want and want[:6] != want[6:12]
    samples.hand_back()
    assert torch.equal(torch.rand(1), after)


def test_another_process_replays_the_saved_states_and_reads_out_of_order_within_its_window():
    torch.manual_seed(4)
    loader = torch.utils.data.DataLoader(DATA, 4, shuffle=True, drop_last=True)
    states = {role: s.copy() for role, s in start_states(loader).items()}
    here = replayed(RunSamples(loader, 30, states), 30)
    torch.manual_seed(99)                    # a worker's own global generator
    there = RunSamples(torch.utils.data.DataLoader(DATA, 4, shuffle=True, drop_last=True), 30, states)
    asked = (3, 1, 2, 29, 0)          # the prefetch's threads ask a little out of order; 0 left the window once
    assert [replayed(there, 30)[b] for b in asked] == [here[b] for b in asked]
    assert [[int(v) for v in there.batch(b)] for b in asked] == [here[b] for b in asked]


def test_a_run_of_a_billion_steps_starts_at_once_and_keeps_a_window():
    """Nothing is drawn up front (the whole order of 10^9 steps would take minutes and gigabytes)."""
    import time
    torch.manual_seed(0)
    loader = torch.utils.data.DataLoader(DATA, 4, shuffle=True, drop_last=True)
    start = time.process_time()
    samples = RunSamples(loader, 10 ** 9, start_states(loader))
    for b in range(3 * WINDOW_BATCHES):
        samples.batch(b)
    assert len(samples) == 4 * 10 ** 9 and len(samples._kept) == WINDOW_BATCHES
    assert time.process_time() - start < 30   # 768 batches; the whole order up front: about 1400 s of CPU


def test_an_iterable_is_read_a_pass_an_epoch_and_a_custom_sampler_is_refused():
    class Pairs(torch.utils.data.IterableDataset):
        def __iter__(self):
            return ((torch.tensor([float(i)]), i % 2) for i in range(10))   # 2 batches of 4, 2 left over

    samples = RunSamples(torch.utils.data.DataLoader(Pairs(), 4, drop_last=True), 5, None)
    firsts = [float(samples.get(np.arange(b * 4, b * 4 + 4))[0][0, 0]) for b in range(5)]
    assert firsts == [0.0, 4.0, 0.0, 4.0, 0.0]

    class Backwards(torch.utils.data.Sampler):
        def __iter__(self):
            return iter(range(23, -1, -1))

        def __len__(self):
            return 24

    loader = torch.utils.data.DataLoader(DATA, 4, sampler=Backwards(), drop_last=True)
    with pytest.raises(CsTorchError, match="sampler Backwards is not one of torch's"):
        start_states(loader)


def test_dict_samples_stream_as_named_inputs_and_labels_and_one_without_labels_is_refused():
    """The model zoo's dict samples: the workers stream each named tensor but the labels as an input
    (map-style and iterable alike, in the loader's order and dtypes), the labels as the target."""
    rows = [{"input_ids": torch.arange(3, dtype=torch.int32) + i, "attention_mask": torch.ones(3, dtype=torch.int32),
             "labels": torch.tensor(i % 2, dtype=torch.int32)} for i in range(8)]
    torch.manual_seed(0)
    loader = torch.utils.data.DataLoader(rows, 4, shuffle=True, drop_last=True)
    want = [b for _ in range(2) for b in loader]
    torch.manual_seed(0)
    loader = torch.utils.data.DataLoader(rows, 4, shuffle=True, drop_last=True)
    samples = RunSamples(loader, 4, start_states(loader))
    for b, batch in enumerate(want):
        x, y = samples.get(np.arange(b * 4, b * 4 + 4))
        assert sorted(x) == ["attention_mask", "input_ids"] and x["input_ids"].dtype == np.int32
        np.testing.assert_array_equal(x["input_ids"], batch["input_ids"].numpy())
        np.testing.assert_array_equal(y, batch["labels"].numpy())

    unlabelled = torch.utils.data.DataLoader([{"input_ids": torch.zeros(3)}] * 4, 4)
    with pytest.raises(CsTorchError, match="a dict sample needs a 'labels' entry .* it has input_ids$"):
        RunSamples(unlabelled, 1, start_states(unlabelled))


def test_an_iterable_of_whole_batches_streams_them_with_its_first_batchs_size():
    """DataLoader(batch_size=None) over a data set that yields dicts of batched arrays (the model zoo's
    BERT processor): each batch as it was yielded, a pass an epoch; a batch of another size is refused."""
    class Batches(torch.utils.data.IterableDataset):
        def __init__(self, sizes):
            self.sizes = sizes

        def __iter__(self):
            for b, size in enumerate(self.sizes):
                yield {"input_ids": np.full((size, 2), b, dtype=np.int32), "labels": np.arange(size, dtype=np.int32)}

    samples = RunSamples(torch.utils.data.DataLoader(Batches([3, 3]), batch_size=None), 3, None)
    assert samples.batch_size == 3
    firsts = [int(samples.get(np.arange(b * 3, b * 3 + 3))[0]["input_ids"][0, 0]) for b in range(3)]
    assert firsts == [0, 1, 0]
    ragged = RunSamples(torch.utils.data.DataLoader(Batches([3, 2]), batch_size=None), 2, None)
    with pytest.raises(CsTorchError, match="batches have 2 and 3 samples"):
        ragged.get(np.arange(3, 6))


def test_cstorchs_distributed_sampler_replays_its_own_order_here_and_in_another_process():
    import cerebras.pytorch as cstorch
    data = torch.utils.data.TensorDataset(torch.arange(10.0).reshape(10, 1), torch.arange(10) % 3)
    make = lambda: torch.utils.data.DataLoader(   # noqa: E731  (10 samples, batches of 4: leftovers carry over)
        data, batch_sampler=cstorch.utils.data.DistributedSampler(data, shuffle=True, seed=5, batch_size=4))
    want = torch_order(make(), 4)
    loader = make()
    states = start_states(loader)
    samples = RunSamples(loader, len(want), states)
    assert [[int(v) for v in samples.get(np.arange(b * 4, b * 4 + 4))[0][:, 0]] for b in range(len(want))] == want
    assert loader.batch_sampler.replay_state().tolist() == [0, 0]    # the user's sampler untouched while drawing
    there = RunSamples(make(), len(want), states)                     # a worker's own loader, the saved place
    assert [[int(v) for v in there.batch(b)] for b in (3, 0, 5)] == [want[3], want[0], want[5]]
    samples.hand_back()                                              # then as iterating it would leave it
    assert loader.batch_sampler.replay_state()[0] == 4
