"""The real coding agents against ``hearth serve``: Claude Code (headless ``-p``, json and
stream-json output), OpenCode (``opencode run``) and Codex (``codex exec``, over the Responses
API), installed from npm, with no proxy and no special flags, on a tiny checkpoint with a 32k
context (the demo's weights).

Opt-in (``-m clients`` / ``make test-clients``): it needs node and the npm registry, and takes
minutes (Claude Code's first prompt is tens of thousands of tokens). It skips without node.
Set ``HEARTH_AGENTS_DIR`` to reuse an install between runs."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from tests.serving_helpers import metrics, running_server

pytestmark = pytest.mark.clients
PACKAGES = ["@anthropic-ai/claude-code", "opencode-ai", "@openai/codex"]
CONTEXT = 32768
RUN_S = 600  # one agent invocation, a cold 28k-token prompt included


@pytest.fixture(scope="module")
def agents(tmp_path_factory) -> Path:
    """The agents' install folder (``node_modules/.bin/{claude,opencode}``)."""
    if shutil.which("node") is None or shutil.which("npm") is None:
        pytest.skip("node and npm are needed for the agent-client tests")
    where = Path(os.environ.get("HEARTH_AGENTS_DIR") or tmp_path_factory.mktemp("agents"))
    bins = [where / "node_modules" / ".bin" / name for name in ("claude", "opencode", "codex")]
    if not all(b.exists() for b in bins):
        done = subprocess.run(["npm", "install", "--no-audit", "--no-fund", "--prefix", str(where), *PACKAGES],
                              capture_output=True, text=True, timeout=600)
        if done.returncode != 0:
            pytest.skip(f"npm install failed (no registry?): {done.stderr[-500:]}")
    return where / "node_modules" / ".bin"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """hearth serving the demo's weights with a 32k context, as the model ``tiny``."""
    from hearth.engine.checkpoint.demo import demo_model_dir

    model = tmp_path_factory.mktemp("demo-32k") / "m"
    shutil.copytree(demo_model_dir(), model)
    config = json.loads((model / "config.json").read_text())
    config["max_position_embeddings"] = CONTEXT
    (model / "config.json").write_text(json.dumps(config))
    with running_server(model, {"max_model_len": CONTEXT}, scripted=False) as srv:
        yield srv


def _env(home: Path, **extra: str) -> dict[str, str]:
    # PWD too: OpenCode takes its project folder from it, not from the working directory.
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ANTHROPIC_", "OPENAI_", "CLAUDE_"))}
    env.update({"HOME": str(home), "PWD": str(home), "DISABLE_AUTOUPDATER": "1", "DISABLE_TELEMETRY": "1",
                "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1", **extra})
    return env


def _claude(agents: Path, server, home: Path, *args: str) -> subprocess.CompletedProcess:
    env = _env(home, ANTHROPIC_BASE_URL=server.url, ANTHROPIC_AUTH_TOKEN="unused", ANTHROPIC_MODEL="tiny",
               ANTHROPIC_SMALL_FAST_MODEL="tiny", CLAUDE_CODE_MAX_OUTPUT_TOKENS=str(CONTEXT // 4))
    return subprocess.run([str(agents / "claude"), "-p", *args, "--max-turns", "3"], capture_output=True, text=True,
                          timeout=RUN_S, env=env, cwd=home)


def test_claude_code_json_then_a_cached_second_turn(agents, server, tmp_path) -> None:
    first = _claude(agents, server, tmp_path, "Write a Python function that adds two numbers.",
                    "--output-format", "json")
    assert first.returncode == 0, first.stderr[-2000:] + first.stdout[-2000:]
    result = json.loads(first.stdout)
    assert result["type"] == "result" and "result" in result, result
    before = metrics(server).get("hearth_cached_prompt_tokens_total", 0)
    second = _claude(agents, server, tmp_path, "Now make it subtract.", "--continue", "--output-format", "json")
    assert second.returncode == 0, second.stderr[-2000:] + second.stdout[-2000:]
    again = json.loads(second.stdout)
    cached = again.get("usage", {}).get("cache_read_input_tokens", 0)
    print(f"\nclaude -p: turn 1 {result.get('duration_ms')} ms, turn 2 {again.get('duration_ms')} ms, "
          f"turn 2 cache_read_input_tokens {cached}")
    assert cached > 0 and metrics(server)["hearth_cached_prompt_tokens_total"] > before


def test_claude_code_stream_json(agents, server, tmp_path) -> None:
    done = _claude(agents, server, tmp_path, "Say hello.", "--output-format", "stream-json", "--verbose")
    assert done.returncode == 0, done.stderr[-2000:] + done.stdout[-2000:]
    events = [json.loads(line) for line in done.stdout.splitlines() if line.strip()]
    assert events[0]["type"] == "system" and events[-1]["type"] == "result", [e["type"] for e in events]
    assert any(e["type"] == "assistant" for e in events)


def test_opencode_run(agents, server, tmp_path) -> None:
    config = {"$schema": "https://opencode.ai/config.json", "provider": {"hearth": {
        "npm": "@ai-sdk/openai-compatible", "name": "hearth", "options": {"baseURL": server.url + "/v1"},
        "models": {"tiny": {"name": "tiny", "limit": {"context": CONTEXT, "output": CONTEXT // 4}}}}}}
    (tmp_path / "opencode.json").write_text(json.dumps(config))
    done = subprocess.run([str(agents / "opencode"), "run", "-m", "hearth/tiny", "Write a haiku about Python."],
                          capture_output=True, text=True, timeout=RUN_S, env=_env(tmp_path), cwd=tmp_path)
    print(f"\nopencode run: rc {done.returncode}, {len(done.stdout)} characters printed")
    assert done.returncode == 0, done.stderr[-2000:] + done.stdout[-2000:]
    assert done.stdout.strip()


def test_codex_exec_over_the_responses_api(agents, server, tmp_path) -> None:
    (tmp_path / ".codex").mkdir()
    (tmp_path / ".codex" / "config.toml").write_text(
        'model = "tiny"\nmodel_provider = "hearth"\n\n[model_providers.hearth]\nname = "hearth"\n'
        f'base_url = "{server.url}/v1"\nwire_api = "responses"\n')
    work = tmp_path / "work"
    work.mkdir()
    done = subprocess.run([str(agents / "codex"), "exec", "--skip-git-repo-check", "Write a haiku about Python."],
                          capture_output=True, text=True, timeout=RUN_S, env=_env(tmp_path, PWD=str(work)), cwd=work,
                          stdin=subprocess.DEVNULL)
    print(f"\ncodex exec: rc {done.returncode}, {len(done.stdout)} characters printed")
    assert done.returncode == 0, done.stderr[-2000:] + done.stdout[-2000:]
    assert done.stdout.strip()
