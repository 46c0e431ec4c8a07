"""m2export/kernels/_host.py: the decay check's cache under ``torch.inference_mode()``.

``m2export check --reference-backend cutile`` runs the PyTorch model under inference mode; its tensors have no
version counter (reading ``_version`` raised RuntimeError inside the first cuTile scan: found on the H200).
"""

from __future__ import annotations

import pytest
import torch

from m2export.contract import ContractError
from m2export.kernels._host import check_decay_once, tensor_version
from tests.helpers import requires_cutile


def test_tensor_version_of_normal_and_inference_tensors():
    t = -torch.rand(4)
    v = tensor_version(t)
    t.mul_(2)
    assert tensor_version(t) == v + 1
    with torch.inference_mode():
        assert tensor_version(-torch.rand(4)) is None


def test_decay_check_on_the_cpu_under_inference_mode():
    with torch.inference_mode():
        check_decay_once(-torch.rand(3))
        with pytest.raises(ContractError):
            check_decay_once(torch.tensor([-1.0, 0.5]))


@pytest.mark.gpu
@requires_cutile
def test_decay_check_is_not_cached_for_inference_tensors():
    """An inference tensor cannot report an in-place change, so every call checks it again: a decay that turns
    positive in place is refused on the next call."""
    with torch.inference_mode():
        A = -torch.rand(8, device="cuda") - 0.1
        check_decay_once(A)
        check_decay_once(A)
        A.neg_()
        with pytest.raises(ContractError):
            check_decay_once(A)
