"""Host values onto a device: the int64 array path gives what torch.tensor gives, and every other input still goes
through torch.tensor."""

import pytest
import torch

from fulcrum.utils.device import host_tensor, to_device


@pytest.mark.parametrize(
    "values, dtype",
    [
        (list(range(3500)), torch.long),  # a decode step's packed fields: the array path
        ([0, -1, 2**62], torch.long),
        ([True, False, 3], torch.long),
        ([1, 2.7, 3], torch.long),  # a float after the first int: torch.tensor truncates, as before
        ([2.7, 1], torch.long),
        ([[1, 2], [3, 4]], torch.long),  # nested: torch.tensor's shape
        ([], torch.long),
        ([0.5, 1.5], torch.float32),
        ([1, 2], None),
    ],
)
def test_host_values_equal_torch_tensor(values, dtype):
    want = torch.tensor(values, dtype=dtype)
    got = host_tensor(values, dtype)
    assert got.dtype == want.dtype and got.shape == want.shape and torch.equal(got, want)
    on_cpu = to_device(values, torch.device("cpu"), dtype)
    assert torch.equal(on_cpu, want)


def test_an_int_past_int64_is_torch_tensors_error():
    with pytest.raises(ValueError, match="Overflow"):
        torch.tensor([1, 2**63], dtype=torch.long)
    with pytest.raises(ValueError, match="Overflow"):
        host_tensor([1, 2**63], torch.long)
