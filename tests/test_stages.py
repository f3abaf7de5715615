"""Pipeline stages as a pure function: which machines a too-big model is split over, and where."""

from __future__ import annotations

import pytest

from hearth.cluster.placement import GIB, NodeInfo, PlacementError, PlacementPolicy
from hearth.cluster.stages import plan_stages

POLICY = PlacementPolicy(min_headroom_bytes=2 * GIB, headroom_fraction=0.0)


def machine(name: str, ram_gib: float, cores: int = 8, b_h: float | None = None, alive: bool = True) -> NodeInfo:
    return NodeInfo(name, "10.0.0.1", int(ram_gib * GIB), int(ram_gib * GIB), cores, (), frozenset({name}), alive,
                    b_h=b_h)


def layers(count: int, gib: float) -> list[int]:
    return [int(gib * GIB)] * count


def test_a_model_bigger_than_either_machine_is_split_over_both() -> None:
    # 48 layers of 1.8 GiB (86 GiB) + 1 GiB embeddings + 1 GiB head: neither 64 nor 32 GiB holds it.
    desktop, laptop = machine("desktop", 64, b_h=40e9), machine("laptop", 34, b_h=20e9)
    stages = plan_stages([laptop, desktop], "big", layers(48, 1.8), GIB, GIB, POLICY)
    assert [(s.node_name, s.first_layer, s.end_layer) for s in stages] == [("desktop", 0, 32), ("laptop", 32, 48)]
    assert all(s.ram_bytes <= (62 if s.node_name == "desktop" else 32) * GIB for s in stages)
    assert stages[0].ram_bytes == 32 * int(1.8 * GIB) + GIB  # 2:1 by speed
    assert stages[1].stage_id == "big/stage1@laptop"


def test_layers_follow_speed_where_ram_allows() -> None:
    # Plenty of RAM on both: the 3x faster machine takes about 3/4 of the layers.
    fast, slow = machine("fast", 200, b_h=30e9), machine("slow", 200, b_h=10e9)
    stages = plan_stages([fast, slow], "m", layers(40, 1.0), 0, 0, POLICY, speeds={"fast": 3.0, "slow": 1.0})
    assert len(stages) == 1  # it fits on the fastest machine alone: no hop at all
    small_fast = machine("fast", 32, b_h=30e9)
    stages = plan_stages([small_fast, slow], "m", layers(40, 1.0), 0, 0, POLICY)
    assert [(s.node_name, s.end_layer - s.first_layer) for s in stages] == [("fast", 30), ("slow", 10)]


def test_the_fewest_fastest_machines_are_used_and_dead_ones_skipped() -> None:
    nodes = [machine("a", 40, cores=16), machine("b", 40, cores=8), machine("c", 40, cores=4),
             machine("d", 400, cores=32, alive=False)]
    stages = plan_stages(nodes, "m", layers(30, 2.0), 0, 0, POLICY)
    assert [s.node_name for s in stages] == ["a", "b"]  # 60 GiB: two machines suffice
    assert stages[0].first_layer == 0 and stages[-1].end_layer == 30
    assert all(a.end_layer == b.first_layer for a, b in zip(stages, stages[1:], strict=False))


def test_too_big_for_the_whole_cluster_says_how_short() -> None:
    with pytest.raises(PlacementError, match="60.0 GiB short"):
        plan_stages([machine("a", 22), machine("b", 22)], "huge", layers(50, 2.0), 0, 0, POLICY)
    with pytest.raises(PlacementError, match="2 pipeline stages need 2 machines; the cluster has 1 live"):
        plan_stages([machine("a", 220), machine("b", 220, alive=False)], "m", layers(50, 2.0), 0, 0, POLICY,
                    min_stages=2)


@pytest.mark.parametrize("family, cut, micro, hierarchy", [
    ("qwen3_moe", 1, 1, False), ("qwen3_moe", 2, 2, False), ("deepseek_v3", 2, 1, False), ("deepseek_v3", 2, 2, False),
    ("gpt_oss", 1, 2, False), ("glm4_moe", 1, 1, False), ("qwen3_moe", 1, 2, True), ("deepseek_v3", 2, 1, True),
    ("qwen3_next", 1, 1, False), ("qwen3_next", 2, 2, False), ("qwen3_5_moe", 3, 2, True),
    ("deepseek_v4", 1, 2, False), ("deepseek_v4", 2, 1, True), ("glm_moe_dsa", 2, 1, False)])
def test_two_stages_give_one_engines_tokens_and_logits(checkpoint, family, cut, micro, hierarchy) -> None:
    """A model split into two engines, each loading only its layers (and their experts and KV cache):
    the first schedules, embeds and samples; the second runs the rest and the head. Staggered
    requests with chunked prefill give the tokens and logits of one engine; with ``micro`` 2, each
    step goes in two micro-batches, the second stage (on its own thread) working on one while the
    first computes the next. With ``hierarchy``, each stage runs the expert hierarchy (a device
    expert cache, misses split between fills and the CPU) over its own layers. Hybrid models
    (Qwen3-Next, Qwen3.5) keep each stage's recurrent states in the first stage's slots; DeepSeek-V4
    passes its hyper-connection streams between the stages."""
    from concurrent.futures import ThreadPoolExecutor

    from hearth.config import EngineConfig
    from hearth.engine import LLM, LLMEngine
    from tests.helpers import greedy, max_rel_error, record_logits
    from tests.test_batching import PROMPTS, run_staggered

    path, _ = checkpoint(family)
    # Hybrid models: two sequences at a time, so that state slots are reused (a later stage must
    # start a new request's states from zeros, not from the last owner's).
    config = EngineConfig(kv_cache_tokens=1024, prefill_chunk=8, max_num_batched_tokens=12,
                          **({"expert_device": "virtual", "expert_cache": "0.3"} if hierarchy else {}),
                          **({"max_num_seqs": 2} if family in ("qwen3_next", "qwen3_5_moe") else {}))
    whole = LLM(path, config=config)
    layers = whole.engine.model_config.num_layers
    later = LLMEngine(path, config, layers=(cut, layers))
    staged = object.__new__(LLM)
    thread = ThreadPoolExecutor(1)  # the second stage's own worker: one step at a time, in order
    hand_on = (lambda batch, hidden: thread.submit(later.stage_forward, batch, hidden)) if micro > 1 \
        else later.stage_forward
    staged.engine = LLMEngine(path, config, layers=(0, cut), next_stage=hand_on)
    staged.engine.runner.micro_batches = micro
    # Each stage holds only its own part.
    assert later.pool.moe_layer_ids == [i for i in whole.engine.pool.moe_layer_ids if i >= cut]
    assert staged.engine.pool.moe_layer_ids == [i for i in whole.engine.pool.moe_layer_ids if i < cut]
    full = whole.engine.model_config
    assert [k.numel() > 0 for k in later.runner.kv.keys] == [i >= cut and not full.is_linear_layer(i)
                                                            for i in range(layers)]
    recorded = {"whole": record_logits(whole), "staged": record_logits(staged)}
    results = {name: run_staggered(llm, [greedy(12)] * len(PROMPTS)) for name, llm in
               (("whole", whole), ("staged", staged))}
    assert results["staged"] == results["whole"]
    if hierarchy:  # both stages' caches missed and filled or ran experts on the CPU, for their layers only
        for engine in (staged.engine, later):
            experts = engine.stats()["experts"]
            assert experts["fill_calls"] + experts["cpu_calls"] > 0, experts
    for rid, logits in recorded["whole"].items():
        staged_logits = recorded["staged"][rid]
        assert len(staged_logits) == len(logits) and all(
            max_rel_error(a, b) <= 1e-5 for a, b in zip(staged_logits, logits, strict=True))


def test_stage_bounds_and_unsupported_kinds_are_refused(checkpoint) -> None:
    from hearth.config import ConfigError, EngineConfig
    from hearth.engine import LLMEngine

    path, _ = checkpoint("qwen3_moe")
    with pytest.raises(ConfigError, match="not within"):
        LLMEngine(path, EngineConfig(), layers=(2, 9))
    with pytest.raises(ConfigError, match="needs the later stages"):
        LLMEngine(path, EngineConfig(), layers=(0, 1))
    with pytest.raises(ConfigError, match="eager steps"):
        LLMEngine(path, EngineConfig(static_decode="eager"), layers=(1, 3))


def test_a_lost_stage_ends_the_requests_it_held_and_the_engine_goes_on(checkpoint) -> None:
    """A later stage that dies mid-step (and comes back empty) ends the running requests with a
    StageLost naming them; a request still waiting goes on, and a prompt whose prefix was cached
    before the loss is computed afresh through the new stage: both equal one engine's tokens."""
    from hearth.config import EngineConfig
    from hearth.engine import LLM, LLMEngine
    from hearth.proto.contracts import StageLost
    from tests.helpers import greedy

    path, _ = checkpoint("qwen3_moe")
    config = EngineConfig(kv_cache_tokens=1024, max_num_seqs=1)
    whole = LLM(path, config=config)
    prompts = ["the cached prefix of a long agent prompt, then one", "a second prompt that waits its turn"]
    expected = [whole.generate([p], greedy(8))[0].token_ids for p in prompts]
    layers = whole.engine.model_config.num_layers
    stage = {"engine": LLMEngine(path, config, layers=(1, layers)), "fail_at": None, "calls": 0}

    def later(batch, hidden):
        stage["calls"] += 1
        if stage["calls"] == stage["fail_at"]:
            stage["engine"] = LLMEngine(path, config, layers=(1, layers))  # restarted: an empty KV cache
            raise StageLost("stage 1 died")
        return stage["engine"].stage_forward(batch, hidden)

    engine = LLMEngine(path, config, layers=(0, 1), next_stage=later)

    def run(request_ids: list[str]) -> dict[str, list[int]]:
        done: dict[str, list[int]] = {}
        while engine.has_unfinished():
            for out in engine.step():
                if out.finished:
                    done[out.request_id] = out.token_ids
        return {rid: done[rid] for rid in request_ids}

    assert run([engine.add_request(prompts[0], greedy(8), "warm")]) == {"warm": expected[0]}  # now cached
    stage["fail_at"] = stage["calls"] + 4  # mid-decode of the next request
    first = engine.add_request(prompts[0], greedy(8), "lost")
    waiting = engine.add_request(prompts[1], greedy(8), "waits")
    with pytest.raises(StageLost) as lost:
        run([first, waiting])
    assert lost.value.request_ids == ("lost",) and "stage 1 died" in str(lost.value)
    assert engine.stats()["kv_blocks_cached"] == 0  # the old stage's pages are not trusted again
    again = engine.add_request(prompts[0], greedy(8), "again")
    assert run([waiting, again]) == {"waits": expected[1], "again": expected[0]}


def test_an_owners_ram_limit_is_the_budget(monkeypatch) -> None:
    """``HEARTH_RAM_LIMIT`` on a machine caps what a plan may fill there (no headroom on top): a
    model that the machines' free RAM would hold alone is split once each lets hearth use less."""
    from dataclasses import replace

    from hearth.cluster.node_info import ram_limit
    from hearth.cluster.placement import ModelSpec, plan_placement
    from hearth.config import ConfigError

    big = [machine("desktop", 64), machine("laptop", 32)]
    model = ModelSpec("m", "/m", int(36 * GIB), int(4 * GIB))
    assert [r.node_name for r in plan_placement(big, [model]).replicas] == ["desktop"]
    limited = [replace(n, ram_limit_bytes=24 * GIB) for n in big]
    with pytest.raises(PlacementError, match="fits on no node"):
        plan_placement(limited, [model])
    stages = plan_stages(limited, "m", layers(40, 1.0), 0, 0)
    assert [(s.node_name, s.end_layer - s.first_layer) for s in stages] == [("desktop", 20), ("laptop", 20)]
    monkeypatch.setenv("HEARTH_RAM_LIMIT", "24GiB")
    assert ram_limit() == 24 * GIB
    monkeypatch.setenv("HEARTH_RAM_LIMIT", "lots")
    with pytest.raises(ConfigError, match="HEARTH_RAM_LIMIT='lots'"):
        ram_limit()
    monkeypatch.delenv("HEARTH_RAM_LIMIT")
    assert ram_limit() is None


def test_a_hybrid_stage_starts_each_new_request_from_zero_states(checkpoint) -> None:
    """A later stage of a hybrid model whose state slot still holds a finished request's convolution
    window and recurrent state starts the next request in that slot from zeros, as the first stage
    does (the tiny model's fast decay hides stale state in its tokens, so the states are compared)."""
    import torch

    from hearth.config import EngineConfig
    from hearth.engine import LLMEngine
    from tests.helpers import greedy

    path, _ = checkpoint("qwen3_next")
    config = EngineConfig(kv_cache_tokens=512, max_num_seqs=1)
    layers = 4
    clean, reused = (LLMEngine(path, config, layers=(1, layers)) for _ in range(2))
    for pool in (reused.runner.states.conv, reused.runner.states.recurrent):
        for state in pool.values():
            state.fill_(3.0)  # what the slot's last request left

    def both(batch, hidden):
        reused.stage_forward(batch, hidden)
        return clean.stage_forward(batch, hidden)

    first = LLMEngine(path, config, layers=(0, 1), next_stage=both)
    first.add_request("a new request in a used slot", greedy(4))
    while first.has_unfinished():
        first.step()
    for pool in ("conv", "recurrent"):
        mine, theirs = getattr(reused.runner.states, pool), getattr(clean.runner.states, pool)
        assert mine.keys() == theirs.keys() == {1, 2}
        assert all(torch.equal(mine[i], theirs[i]) for i in mine), pool


def test_a_quantized_checkpoint_is_planned_at_its_stored_size(checkpoint, tmp_path) -> None:
    """A GGUF file runs with its weights in their blocks: the planner counts its layers at about the
    file's size, not at float32's."""
    from hearth.cluster.sizing import layer_sizes, model_spec
    from hearth.engine.checkpoint.gguf_writer import write_gguf

    src, _ = checkpoint("qwen3_moe")
    gguf = write_gguf(src, tmp_path / "m.gguf", "q8_0")
    floats, quantized = layer_sizes(str(src)), layer_sizes(str(gguf))
    total = sum(quantized[0]) + quantized[1] + quantized[2]
    assert 0.2 < total / (sum(floats[0]) + floats[1] + floats[2]) < 0.4  # q8_0: ~8.5 bits of 32
    assert abs(total - gguf.stat().st_size) / gguf.stat().st_size < 0.1
    spec = model_spec(str(gguf), "m")
    assert abs(spec.pool_bytes + spec.dense_bytes - total) / total < 0.05


def test_a_batch_moves_to_another_stage_without_what_its_layers_cached() -> None:
    """What a stage sends on: the batch's tensors on the target device (``meta`` here stands for a
    GPU or another machine), its per-sequence block tables too, and none of the masks the first
    stage's layers cached on it."""
    import torch

    from hearth.engine.executor.runner import build_batch
    from hearth.engine.request import Request
    from hearth.proto.contracts import SamplingParams

    req = Request("r", list(range(40)), SamplingParams())
    req.block_table = [3, 4, 5]
    batch, _ = build_batch([(req, 40)], 16)
    batch.masks[(0, None, True)] = torch.ones(40, 40, dtype=torch.bool)
    moved = batch.moved("meta")
    assert all(t.device.type == "meta" for t in (moved.token_ids, moved.positions, moved.slot_mapping,
                                                 moved.logits_indices, moved.sequences[0].block_ids))
    assert moved.masks == {} and len(batch.masks) == 1 and batch.token_ids.device.type == "cpu"
    back = batch.moved("cpu")
    assert torch.equal(back.slot_mapping, batch.slot_mapping) and back.sequences[0].first_block == 3


def test_a_stage_begins_only_where_the_model_allows() -> None:
    # GLM-5's shared sparse-attention layers (odd ones here) need the layer before them in the same pass.
    fast, slow = machine("fast", 32, b_h=30e9), machine("slow", 200, b_h=10e9)
    may_start = [i % 2 == 0 for i in range(40)]
    stages = plan_stages([fast, slow], "m", layers(40, 1.0), 0, 0, POLICY, may_start=may_start)
    assert len(stages) == 2 and all(may_start[s.first_layer] for s in stages)
    assert stages[0].end_layer == stages[1].first_layer and stages[0].end_layer % 2 == 0
    unconstrained = plan_stages([fast, slow], "m", layers(40, 1.0), 0, 0, POLICY)
    assert unconstrained[0].end_layer == 30  # (30 is a start anyway: the constraint moves nothing here)
    odd = plan_stages([fast, slow], "m", layers(40, 1.0), 0, 0, POLICY, may_start=[i != 30 for i in range(40)])
    assert odd[0].end_layer == 29  # one layer earlier: the stage may not grow past its room
