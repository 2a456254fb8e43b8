"""The batches of the models written by others (tests/other_models.py), with numpy alone:
an input worker of tests/others_run.py streams them without importing torch or building
the model."""
import numpy as np

BATCH, T, VOCAB = 4, 8, 32


def lm_batches(rng, steps):
    out = []
    for _ in range(steps):
        ids = rng.integers(0, VOCAB, (BATCH, T))
        out.append(({"input_ids": ids, "labels": ids.copy()}, ids.copy()))
    return out


def mlm_batches(rng, steps):
    out = []
    for _ in range(steps):
        ids = rng.integers(1, VOCAB, (BATCH, T))
        lengths = rng.integers(3, T + 1, BATCH)
        mask = (np.arange(T)[None, :] < lengths[:, None]).astype(np.int64)
        labels = np.where(mask == 0, -100, rng.integers(0, VOCAB, (BATCH, T)))
        out.append(({"input_ids": ids * mask, "attention_mask": mask}, labels))
    return out


def image_batches(rng, steps, size=16):
    return [(rng.standard_normal((BATCH, 3, size, size)).astype(np.float32), rng.integers(0, 5, BATCH))
            for _ in range(steps)]


def next_token_batches(rng, steps):
    """nanoGPT's: the ids, and the next ids as labels (-1, ignored, after the last)."""
    out = []
    for _ in range(steps):
        ids = rng.integers(0, VOCAB, (BATCH, T))
        labels = np.roll(ids, -1, axis=1)
        labels[:, -1] = -1
        out.append((ids, labels))
    return out


def class_images(rng, steps, batch=BATCH, size=32, noise=3.0):
    """32x32 images whose class shows: a fixed blocky pattern per class (4x4 blocks of seeded
    colours) under noise of `noise` times its scale, so training learns a pattern at a pace that
    batch norm in training keeps smooth (tests/test_torch_others.py, TRAINING)."""
    coarse = np.random.default_rng(7).standard_normal((5, 3, 4, 4))
    patterns = np.kron(coarse, np.ones((size // 4, size // 4)))
    out = []
    for _ in range(steps):
        y = rng.integers(0, 5, batch)
        out.append(((patterns[y] + noise * rng.standard_normal((batch, 3, size, size))).astype(np.float32), y))
    return out


def images_32(rng, steps):
    """32x32 images: at 16 resnet18's last stages would see 2x2 and 1x1 maps."""
    return image_batches(rng, steps, size=32)


# kind -> batches_of(rng, steps); tests/other_models.py builds the model of each kind.
BATCHES = {"nanogpt": next_token_batches, "gpt2": lm_batches, "bert_masked_lm": mlm_batches, "llama": lm_batches,
           "resnet18": class_images, "mobilenet_v3_small": class_images, "vit": image_batches}


def first_batch(batches_of):
    """The batch a model is captured on: the first of its batches (seed 3), every run's first."""
    return batches_of(np.random.default_rng(3), 1)[0]


def as_dataset(batches_list):
    """A list of (features, labels) batches as one data set of arrays indexed by sample."""
    xs, ys = zip(*batches_list)
    labels = np.concatenate(ys)
    if isinstance(xs[0], dict):
        return {k: np.concatenate([x[k] for x in xs]) for k in xs[0]}, labels
    return np.concatenate(xs), labels
