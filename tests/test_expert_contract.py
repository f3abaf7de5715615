"""The expert subsystem's implementations provide what its protocols promise (the cluster and the
model rely on nothing else)."""

from __future__ import annotations

import inspect

import pytest

from hearth.engine.experts import contract
from hearth.engine.experts.backend import HierarchicalExpertBackend
from hearth.engine.experts.compute import LocalExpertBackend
from hearth.engine.experts.mechanism.cpu_workers import CpuExpertWorkers
from hearth.engine.experts.mechanism.device import CudaDevice, VirtualDevice, contiguous_runs
from hearth.engine.experts.mechanism.ring import ExternalCpuWorkers, ProcessCpuWorkers, RingCpuWorkers


def methods(protocol: type) -> dict[str, inspect.Signature]:
    return {name: inspect.signature(fn) for name, fn in vars(protocol).items()
            if inspect.isfunction(fn) and not name.startswith("_")}


IMPLEMENTATIONS = [
    (contract.ExpertBackend, [LocalExpertBackend, HierarchicalExpertBackend]),
    (contract.ExpertDevice, [VirtualDevice, CudaDevice]),
    (contract.CpuWorkers, [CpuExpertWorkers, RingCpuWorkers, ExternalCpuWorkers, ProcessCpuWorkers]),
    (contract.ExpertControl, [HierarchicalExpertBackend]),
]


@pytest.mark.parametrize("protocol, cls", [(p, c) for p, impls in IMPLEMENTATIONS for c in impls],
                         ids=lambda x: x.__name__)
def test_implementation_has_every_method_with_its_parameters(protocol, cls):
    for name, wanted in methods(protocol).items():
        assert hasattr(cls, name), f"{cls.__name__} lacks {protocol.__name__}.{name}"
        got = inspect.signature(getattr(cls, name))
        assert list(got.parameters) == list(wanted.parameters), f"{cls.__name__}.{name}{got} vs {wanted}"


def test_step_context_is_truthy_only_when_it_streams():
    assert contract.StepContext("stream", 512, 0) and not contract.StepContext("decode", 1, 0)


def test_fills_copy_contiguous_runs_at_once() -> None:
    assert contiguous_runs([], []) == []
    assert contiguous_runs([4, 5, 6, 9, 10, 3], [0, 1, 2, 3, 4, 7]) == [(4, 0, 3), (9, 3, 2), (3, 7, 1)]
    assert contiguous_runs([1, 2, 3], [5, 4, 6]) == [(1, 5, 1), (2, 4, 1), (3, 6, 1)]  # slots out of order
    rows, slots = [7, 8, 2, 3, 4], [10, 11, 0, 1, 2]
    flat = [(r + i, s + i) for r, s, n in contiguous_runs(rows, slots) for i in range(n)]
    assert flat == list(zip(rows, slots, strict=True))
