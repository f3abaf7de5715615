"""Placement as a pure function: cluster shapes -> plans, no Ray involved."""

from __future__ import annotations

import pytest

from hearth.cluster.placement import (
    GIB,
    GpuInfo,
    ModelSpec,
    NodeInfo,
    PlacementError,
    PlacementPolicy,
    plan_placement,
)


def node(node_id: str, ram_gib: float, gpus: tuple[float, ...] = (), cores: int = 8, label: str | None = None,
         alive: bool = True) -> NodeInfo:
    return NodeInfo(node_id, f"10.0.0.{len(node_id)}", int(ram_gib * GIB), int(ram_gib * GIB), cores,
                    tuple(GpuInfo(i, "RTX", int(v * GIB), int(v * GIB)) for i, v in enumerate(gpus)),
                    frozenset({label or node_id}), alive)


def model(name: str = "qwen", pool_gib: float = 10, dense_gib: float = 1, replicas: int | None = None,
          require: str | None = None) -> ModelSpec:
    return ModelSpec(name, f"/models/{name}", int(pool_gib * GIB), int(dense_gib * GIB), replicas, require)


def test_one_gpu_desktop() -> None:
    plan = plan_placement([node("desktop", 64, gpus=(32,))], [model()])
    (r,) = plan.replicas
    assert (r.node_name, r.executor, r.gpu_index) == ("desktop", "cuda", 0)
    # 80 % of 32 GiB free VRAM minus 1 GiB of dense weights, capped at the pool's 10 GiB.
    assert r.expert_cache_bytes == 10 * GIB
    assert r.replica_id == "qwen@desktop"
    assert plan.ram_committed["desktop"] == 11 * GIB


def test_small_gpu_caches_part_of_the_pool() -> None:
    (r,) = plan_placement([node("desktop", 64, gpus=(8,))], [model(pool_gib=40)]).replicas
    assert r.executor == "cuda" and r.expert_cache_bytes == int(8 * GIB * 0.8) - GIB


def test_cpu_only_laptop() -> None:
    (r,) = plan_placement([node("laptop", 16, cores=4)], [model(pool_gib=4, dense_gib=0.5)]).replicas
    assert (r.executor, r.gpu_index, r.expert_cache_bytes, r.cpu_cores) == ("cpu", None, 0, 4)


def test_desktop_and_laptop_both_get_a_replica_gpu_first() -> None:
    plan = plan_placement([node("laptop", 16), node("desktop", 64, gpus=(24,))], [model(pool_gib=4)])
    assert [(r.node_name, r.executor) for r in plan.replicas] == [("desktop", "cuda"), ("laptop", "cpu")]


def test_model_too_big_names_the_shortfall() -> None:
    with pytest.raises(PlacementError) as err:
        plan_placement([node("desktop", 32, gpus=(24,)), node("laptop", 16)], [model(pool_gib=60)])
    msg = str(err.value)
    # needs 60 + 1 + max(2, 3.2) = 64.2 GiB; the desktop has 32 GiB: 32.2 GiB short.
    assert "fits on no node" in msg and "desktop" in msg and "64.2 GiB" in msg and "32.2 GiB short" in msg


def test_only_the_big_node_holds_the_model() -> None:
    plan = plan_placement([node("desktop", 128, gpus=(24,)), node("laptop", 16)], [model(pool_gib=60)])
    assert [r.node_name for r in plan.replicas] == ["desktop"]


def test_two_gpus_host_two_models() -> None:
    plan = plan_placement([node("desktop", 256, gpus=(24, 48))], [model("a", pool_gib=30), model("b", pool_gib=60)])
    by_model = {r.model: r for r in plan.replicas}
    # The larger model is placed first and takes the freer GPU.
    assert by_model["b"].gpu_index == 1 and by_model["a"].gpu_index == 0
    assert plan.ram_committed["desktop"] == (30 + 1 + 60 + 1) * GIB


def test_second_model_falls_back_to_cpu_when_the_only_gpu_is_taken() -> None:
    plan = plan_placement([node("desktop", 256, gpus=(24,))], [model("a", pool_gib=30), model("b", pool_gib=5)])
    assert {r.model: r.executor for r in plan.replicas} == {"a": "cuda", "b": "cpu"}


def test_ram_is_shared_between_models_on_a_node() -> None:
    with pytest.raises(PlacementError, match="'b' fits on no node"):
        plan_placement([node("desktop", 64)], [model("a", pool_gib=30), model("b", pool_gib=30)])


def test_replica_count_and_labels() -> None:
    nodes = [node("desktop", 64, gpus=(24,)), node("laptop", 32)]
    assert len(plan_placement(nodes, [model(replicas=1)]).replicas) == 1
    with pytest.raises(PlacementError, match="asks for 3 replicas but only 2"):
        plan_placement(nodes, [model(replicas=3)])
    (r,) = plan_placement(nodes, [model(require="laptop")]).replicas
    assert r.node_name == "laptop"
    with pytest.raises(PlacementError, match="labelled 'nas'"):
        plan_placement(nodes, [model(require="nas")])


def test_dead_nodes_are_skipped_and_an_empty_cluster_is_an_error() -> None:
    plan = plan_placement([node("desktop", 64, alive=False), node("laptop", 32)], [model()])
    assert [r.node_name for r in plan.replicas] == ["laptop"]
    with pytest.raises(PlacementError, match="no live node"):
        plan_placement([node("desktop", 64, alive=False)], [model()])


def test_gpu_too_small_for_the_dense_weights_means_a_cpu_executor() -> None:
    (r,) = plan_placement([node("desktop", 64, gpus=(2,))], [model(dense_gib=4)]).replicas
    assert r.executor == "cpu"


def test_headroom_policy() -> None:
    nodes = [node("laptop", 12)]
    with pytest.raises(PlacementError):
        plan_placement(nodes, [model(pool_gib=9.5)])  # 9.5 + 1 + 2 > 12
    tight = PlacementPolicy(min_headroom_bytes=GIB, headroom_fraction=0.0)
    assert plan_placement(nodes, [model(pool_gib=9.5)], tight).replicas


def test_plan_is_deterministic() -> None:
    nodes = [node("b", 32), node("a", 32), node("c", 32)]
    plans = {plan_placement(perm, [model(replicas=2)]).replicas for perm in (nodes, nodes[::-1])}
    assert len(plans) == 1


def test_a_joining_node_gets_what_fits_without_moving_the_running_replicas() -> None:
    from hearth.cluster.placement import plan_joiners

    spare = node("spare", 32, gpus=(8,), label="spare")
    big, small = model("big", pool_gib=20), model("small", pool_gib=4)
    held = {"big": frozenset({"desktop"}), "small": frozenset({"desktop", "laptop"})}
    added = plan_joiners([spare], [big, small], {"big": 1, "small": 2}, held)
    assert [(r.model, r.node_name, r.executor) for r in added] == [("big", "spare", "cuda"), ("small", "spare", "cpu")]
    # A node that already holds a model's replica gets none; one too small for a model skips it, no error.
    assert plan_joiners([node("desktop", 64)], [big], {"big": 1}, held) == ()
    assert [r.model for r in plan_joiners([node("tiny", 12)], [big, small], {}, {})] == ["small"]
    # A fixed count is topped up only to what is missing (a node left), on nodes without one.
    fixed = model("big", pool_gib=20, replicas=2)
    assert len(plan_joiners([spare, node("other", 64)], [fixed], {"big": 1}, held)) == 1
    assert plan_joiners([spare], [fixed], {"big": 2}, held) == ()
