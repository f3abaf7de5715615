"""Shared fixtures: tiny random checkpoints built once per test session (no downloads)."""

from __future__ import annotations

import pytest
import torch

from tests.checkpoints import make_checkpoint

FAMILIES = ["qwen3_moe", "qwen2_moe", "mixtral", "qwen3_next", "qwen3_5_moe", "olmoe", "glm4_moe", "deepseek_v3",
            "deepseek_v2", "minimax_m2", "gpt_oss", "deepseek_v4", "dots1",
            "glm4_moe_lite", "granitemoe_shared", "ernie4_5_moe",
            "exaone_moe", "lfm2_moe", "granitemoehybrid",
            "afmoe", "flex_olmo", "cohere2_moe", "phimoe", "hunyuan_v1_moe",
            "granitemoe_swa", "llama4", "jetmoe", "deepseek_v32", "glm_moe_dsa", "kimi_linear",
            "bailing_hybrid", "solar_open", "dbrx", "hy_v3", "mellum", "axk1", "kolibri1", "flint", "laguna",
            "mimo_v2_flash"]


@pytest.fixture(scope="session")
def checkpoint(tmp_path_factory):
    """Factory: checkpoint(family, layout='per_expert', dtype='float32', **overrides) -> (dir, hf_model)."""
    cache: dict[tuple, tuple] = {}

    def build(family: str, layout: str = "per_expert", dtype: str = "float32", **overrides):
        key = (family, layout, dtype, repr(sorted(overrides.items())))
        if key not in cache:
            out = tmp_path_factory.mktemp(f"{family}-{layout}-{dtype}")
            cache[key] = make_checkpoint(out, family, layout, dtype, **overrides)
        return cache[key]

    return build


@pytest.fixture(autouse=True)
def _deterministic_threads():
    torch.manual_seed(0)
    yield


@pytest.fixture(scope="session")
def agent_checkpoint(tmp_path_factory):
    """A tiny fp32 Qwen3-MoE checkpoint with the agent chat template (tools, thinking)."""
    out = tmp_path_factory.mktemp("agent-qwen3")
    path, _ = make_checkpoint(out, "qwen3_moe", chat_format="agent")
    return path


@pytest.fixture(scope="module")
def server(agent_checkpoint):
    """A running server (HTTP + gRPC) over the agent checkpoint, with scripted replies."""
    from tests.serving_helpers import running_server

    with running_server(agent_checkpoint, {"max_model_len": 2048}) as srv:
        yield srv


@pytest.fixture(scope="module")
def oclient(server):
    """The official openai SDK on the module's server."""
    import openai

    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def aclient(server):
    """The official anthropic SDK on the module's server."""
    import anthropic

    return anthropic.Anthropic(base_url=server.url, api_key="unused", max_retries=0)
