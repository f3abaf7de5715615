"""The expert subsystem's implementations provide what its protocols promise (the cluster and the
model rely on nothing else)."""

from __future__ import annotations

import inspect

import pytest

from hearth.engine.experts import contract
from hearth.engine.experts.backend import HierarchicalExpertBackend
from hearth.engine.experts.compute import LocalExpertBackend
from hearth.engine.experts.mechanism.cpu_workers import CpuExpertWorkers
from hearth.engine.experts.mechanism.device import CudaDevice, VirtualDevice
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
