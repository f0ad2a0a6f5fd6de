"""Task encoders several test files share.

``Identity``, ``AnotherSample`` and ``ReAdds`` each do one thing to the sample that decides whether it
is *kept* (the very TokenSample it was given, holding the very objects, in the order its constructor
set them: ``TaskEncoderRunner.encode_rows``; tests/test_encoder_kept.py, tests/test_encoder_loop.py).
``Nested`` makes batches of another structure than the dataset's, which travel packed, not in the
ring (tests/test_task_encoders.py, tests/test_torchft.py).
"""

from __future__ import annotations

import dataclasses

import numpy
import torch


class Identity:
    """Returns the sample as it is: kept."""

    def encode_sample(self, sample):
        return sample


class AnotherSample:
    """The same arrays in another TokenSample: not kept."""

    def encode_sample(self, sample):
        return dataclasses.replace(sample)


class ReAdds:
    """Deletes a field and sets it again to the same array: the sample's fields change order, not kept."""

    def encode_sample(self, sample):
        text = sample.text
        del sample.text
        sample.text = text
        return sample


class Nested:
    """batch() returning nested structures with numpy arrays, tensors, numbers and strings."""

    def encode_sample(self, sample, rng):
        sample.mask = rng.random(sample.text.shape[0]) < 0.5
        return sample

    def batch(self, samples):
        return {
            "tokens": numpy.stack([s.text for s in samples]).astype(numpy.int32),
            "parts": [(s.sample_id, s.source, s.mask) for s in samples],
            "ids": torch.tensor([s.sample_id for s in samples]),
            "meta": {"count": len(samples), "name": "nested", "half": numpy.float16(0.5)},
        }

    def encode_batch(self, batch):
        batch["encoded"] = True
        return batch
