"""``hearth serve`` as a user runs it: the bundled demo model is served with no --model, URLs are printed,
requests are answered, Ctrl-C stops it cleanly."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import requests

from hearth.serving.server import free_port


def test_serve_demo_model_end_to_end(tmp_path):
    port, grpc_port = free_port(), free_port()
    env = dict(os.environ, HEARTH_CACHE=str(tmp_path / "cache"))
    proc = subprocess.Popen(
        [sys.executable, "-m", "hearth.cli.main", "serve", "--port", str(port), "--grpc-port", str(grpc_port),
         "--log-format", "text"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline:
            try:
                if requests.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                    break
            except requests.ConnectionError:
                pass
            assert proc.poll() is None, proc.communicate()
            time.sleep(0.5)
        r = requests.post(f"http://127.0.0.1:{port}/v1/chat/completions", timeout=60, json={
            "model": "hearth-demo", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] >= 1
    finally:
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err
    assert f"OpenAI API     http://127.0.0.1:{port}/v1" in err
    assert f"ANTHROPIC_BASE_URL=http://127.0.0.1:{port}" in err and "trained on Python" in err
    assert "engine/assets/hearth-demo" in err
    assert "path=/v1/chat/completions status=200" in err  # structured request log
    # The agent settings that fit the demo's 4096-token context.
    assert "hearth: context 4096 tokens" in err and "CLAUDE_CODE_MAX_OUTPUT_TOKENS=1024" in err
    assert '"limit": {"context": 4096, "output": 1024}' in err


def test_serve_missing_model_is_a_clear_error(tmp_path):
    out = subprocess.run([sys.executable, "-m", "hearth.cli.main", "serve", "--model", str(tmp_path / "nope")],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 1 and "hearth: error:" in out.stderr and "Traceback" not in out.stderr
