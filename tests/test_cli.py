"""The ``hearth`` command line, run as a user would (a subprocess)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from hearth.engine.checkpoint.dispatch import load_config
from hearth.engine.checkpoint.inspect import summarize
from hearth.engine.models import supported_architectures
from tests.helpers import reference


def hearth(*args: str, stdin: str | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "hearth.cli.main", *args], capture_output=True, text=True, input=stdin, timeout=120
    )


def test_help_lists_commands():
    out = hearth("--help")
    assert out.returncode == 0 and "generate" in out.stdout and "inspect" in out.stdout


def test_generate_streams_text_and_reports_speed(checkpoint):
    path, _ = checkpoint("qwen3_moe")
    out = hearth("generate", "--model", str(path), "--prompt", "def fib", "--max-tokens", "16", "--ignore-eos")
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip()
    assert "decode: 16 tokens" in out.stderr and "tok/s" in out.stderr


def test_generate_chat_template_and_stdin(checkpoint):
    path, _ = checkpoint("mixtral")
    out = hearth("generate", "--model", str(path), "--prompt", "-", "--chat", "--max-tokens", "4", stdin="hello")
    assert out.returncode == 0, out.stderr


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    """A dense Llama checkpoint: an architecture transformers ships and hearth does not serve."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from tests.checkpoints import build_tokenizer

    path = tmp_path_factory.mktemp("llama")
    LlamaForCausalLM(LlamaConfig(vocab_size=384, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                                 num_key_value_heads=1, intermediate_size=64)).save_pretrained(str(path))
    build_tokenizer(path)
    return path


@pytest.mark.parametrize("command", [["generate", "--prompt", "x", "--model"], ["serve", "--port", "0", "--model"],
                                     ["inspect"], ["convert", "{out}"], ["up", "--port", "0", "--model"]])
def test_unsupported_architecture_is_one_line(llama, tmp_path, command):
    """generate, serve, inspect, convert and up refuse an unsupported family in one line, naming it
    and the supported ones, with no traceback (and up before any Ray work)."""
    args = [a.replace("{out}", str(tmp_path / "out")) for a in command]
    args = args + [str(llama)] if args[-1] == "--model" or len(args) == 1 else args[:1] + [str(llama)] + args[1:]
    out = hearth(*args)
    assert out.returncode == 1
    lines = [line for line in out.stderr.splitlines() if line.strip()]
    assert lines == [f"hearth: error: LlamaForCausalLM is not supported; supported: "
                     f"{', '.join(supported_architectures())}"], out.stderr
    assert "OlmoeForCausalLM" in lines[0]


@pytest.mark.parametrize("family, overrides", [("qwen3_moe", {}), ("qwen2_moe", {}), ("mixtral", {}),
                                               ("qwen3_moe", {"mlp_only_layers": [1], "tie_word_embeddings": True})])
def test_inspect_counts_match_transformers(checkpoint, family, overrides):
    path, _ = checkpoint(family, **overrides)
    out = hearth("inspect", str(path), "--json")
    assert out.returncode == 0, out.stderr
    summary = json.loads(out.stdout)
    assert summary["total_params"] == reference(path).num_parameters()
    _, cfg = load_config(path)
    summary.pop("cpu_kernels")  # the machine's, not the checkpoint's (tests/test_kernel_dispatch.py)
    assert summary == summarize(cfg).as_dict()
    assert summary["expert_bytes"] * summary["num_experts"] * summary["num_moe_layers"] == summary["expert_pool_bytes"]


def test_convert_then_generate_on_virtual_device(checkpoint, tmp_path):
    path, _ = checkpoint("qwen3_moe")
    out = hearth("convert", str(path), str(tmp_path / "ftw"), "--dtype", "bf16")
    assert out.returncode == 0, out.stderr
    assert "1 shard(s)" in out.stderr and (tmp_path / "ftw" / "ftw.json").is_file()
    routing = tmp_path / "routing.jsonl"
    out = hearth("generate", "--model", str(tmp_path / "ftw"), "--prompt", "def fib", "--max-tokens", "8",
                 "--ignore-eos", "--virtual-device", "--expert-cache", "0.3", "--virtual-link-gbps", "2",
                 "--record-routing", str(routing))
    assert out.returncode == 0, out.stderr
    assert "cache slots" in out.stderr and "hit rate" in out.stderr
    assert len(routing.read_text().splitlines()) == 8
    bad = hearth("generate", "--model", str(tmp_path / "ftw"), "--prompt", "x", "--virtual-device",
                 "--expert-cache", "12")
    assert bad.returncode == 1 and "bare number is a fraction" in bad.stderr and "Traceback" not in bad.stderr


def test_generate_streams_long_prefill_through_one_or_two_buffers(checkpoint):
    path, _ = checkpoint("qwen3_moe")
    prompt = "def fibonacci(n):\n    return n if n < 2 else fibonacci(n - 1) + fibonacci(n - 2)\n"
    common = ["generate", "--model", str(path), "--prompt", prompt, "--max-tokens", "4", "--ignore-eos",
              "--virtual-device", "--expert-cache", "1.0", "--prefill-chunk", "16", "--stream-min-tokens", "8",
              "--q-mode", "all"]
    two = hearth(*common)
    one = hearth(*common, "--no-double-buffer")
    assert two.returncode == 0 and one.returncode == 0, two.stderr + one.stderr
    assert "through 2 buffer(s)" in two.stderr and "hidden behind compute" in two.stderr
    assert "through 1 buffer(s)" in one.stderr
    assert two.stdout == one.stdout  # the same greedy text either way


def test_profile_without_gpu_reports_host_bandwidth(checkpoint):
    path, _ = checkpoint("qwen3_moe")
    out = hearth("profile", "--model", str(path), "--repeats", "3", "--json")
    assert out.returncode == 0, out.stderr
    report = json.loads(out.stdout)
    assert report["B_H_GBps"] > 0 and len(report["qtable"]) == len(report["rows"])
    memory = report["memory"]  # the GPU executor's memory: weights, KV, slots (the plan needs a GPU)
    assert memory["dense_weight_bytes"] > 0 and memory["kv_bytes_per_token"] > 0 and memory["expert_bytes"] > 0
    if report["device"] is None:
        assert report["qtable"] == [0] * len(report["qtable"])  # no device: every miss on the CPU
    out = hearth("profile", "--model", str(path), "--repeats", "3", "--virtual-device")
    assert out.returncode == 0 and "B_P (virtual)" in out.stdout and "q*" in out.stdout


def test_pool_clean_removes_a_named_segment():
    import uuid

    import torch

    from hearth.engine.experts.mechanism.host_pool import HostExpertPool

    name = f"test-cli-{uuid.uuid4().hex[:8]}"
    pool = HostExpertPool.create(name, (1, 2, 2), (1, 2, 1), torch.float32)
    try:
        assert "hearth-" + name in hearth("pool", "list").stdout
        out = hearth("pool", "clean", name)
        assert out.returncode == 0 and "removed" in out.stdout
    finally:
        pool.close()


def test_generate_on_a_hybrid_model_with_checkpoint_flags(checkpoint):
    path, _ = checkpoint("qwen3_next")
    common = ["generate", "--model", str(path), "--prompt", "def add(a, b):\n    return a + b\n" * 8,
              "--max-tokens", "4", "--ignore-eos", "--prefill-chunk", "32"]
    plain = hearth(*common)
    cached = hearth(*common, "--prefix-caching", "--checkpoints", "periodic", "--checkpoint-interval", "32",
                    "--checkpoint-budget", "1MiB")
    assert plain.returncode == 0 and cached.returncode == 0, plain.stderr + cached.stderr
    assert plain.stdout == cached.stdout
    bad = hearth(*common, "--prefix-caching", "--checkpoint-interval", "20")
    assert bad.returncode != 0 and "checkpoint_interval" in bad.stderr and "Traceback" not in bad.stderr


def test_model_arguments_take_an_optional_name() -> None:
    from pathlib import Path

    from hearth.cli.cluster import model_arg

    assert model_arg("coder=/m/qwen") == ("coder", Path("/m/qwen"))
    assert model_arg("/m/qwen3-moe") == ("qwen3-moe", Path("/m/qwen3-moe"))
    assert model_arg("/m/a=b") == ("a=b", Path("/m/a=b"))  # a path with "=" in it stays a path


def test_up_takes_stages_for_one_model_only() -> None:
    import argparse

    import pytest

    from hearth.cli.cluster import add_commands
    from hearth.cluster.specs import DeployOptions

    parser = argparse.ArgumentParser()
    add_commands(parser.add_subparsers(dest="command"))
    assert parser.parse_args(["up", "--model", "/m/big", "--stages"]).stages
    assert not parser.parse_args(["up", "--model", "/m/big"]).stages
    with pytest.raises(ValueError, match="split one model"):
        DeployOptions("/m/a", "a", stages=True, more_models=(("/m/b", "b"),))


def test_serve_and_up_read_their_flags_from_a_settings_file(tmp_path) -> None:
    """``--config FILE.toml``: keys are the flags, ``models`` a list of ``--model``, ``true`` a bare
    flag; what the command line gives wins, and a broken file is a clear error."""
    from hearth.cli.flags import expand_settings_file
    from hearth.cli.main import build_parser, main

    home = tmp_path / "home.toml"
    home.write_text('models = ["coder=/m/qwen3-coder", "chat=/m/glm"]\nport = 8000\nexpert_cache = "8GiB"\n'
                    'stages = false\nprefix-caching = true\n')
    argv = expand_settings_file(["up", "--config", str(home), "--port", "9000"])
    args = build_parser().parse_args(argv)
    assert args.model == ["coder=/m/qwen3-coder", "chat=/m/glm"] and args.port == 9000
    assert not args.stages and "--prefix-caching" in argv and "8GiB" in argv
    assert expand_settings_file(["inspect", "--config", "x"]) == ["inspect", "--config", "x"]  # only serve and up
    (tmp_path / "bad.toml").write_text("port = \n")
    assert main(["serve", f"--config={tmp_path / 'bad.toml'}"]) == 2
    assert main(["serve", "--config", str(tmp_path / "missing.toml")]) == 2


def test_settings_files_are_typed_input(tmp_path, capsys) -> None:
    """Every key and value is checked against its flag: one line naming the file, the key and what it
    expects, exit 2; never a traceback, whatever the bytes."""
    from hearth.cli.main import main

    cases = {b"\xff\xfeport = 1\n": "not UTF-8", b"x = " + b"[" * 5000 + b"\n": "too deeply",
             b"max-num-seqs = [1, 2]\n": "'max-num-seqs' takes one value",
             b'port = "eighty"\n': "'port' expects an integer",
             b"port = 1.5\n": "expects an integer", b"prefix-caching = 1\n": "expects true or false",
             b'log-format = "xml"\n': "one of json, text", b"no-such-flag = 1\n": "not a setting",
             b"port = 1979-05-27\n": "expects an integer", b"served-model-name = [[1]]\n": "expects a string",
             b"config = 'other.toml'\n": "not a setting"}
    for i, (raw, message) in enumerate(cases.items()):
        path = tmp_path / f"case{i}.toml"
        path.write_bytes(raw)
        capsys.readouterr()
        assert main(["serve", "--config", str(path), "--model", str(tmp_path / "none")]) == 2, raw
        err = capsys.readouterr().err
        assert message in err and str(path) in err and "Traceback" not in err and err.count("\n") == 1, (raw, err)
    good = tmp_path / "good.toml"
    good.write_text('port = 8123\nserved-model-name = ["a", "b"]\nprefix-caching = false\nmax-body-size = "4MiB"\n')
    assert main(["serve", "--config", str(good), "--model", str(tmp_path / "none")]) == 1  # past the file: no model
    assert "no such checkpoint" in capsys.readouterr().err


def test_fuzzed_settings_files_never_end_in_a_traceback(tmp_path, capsys) -> None:
    import random

    from hearth.cli.main import main

    rng = random.Random(7)
    base = b'port = 8000\nhost = "127.0.0.1"\nserved-model-name = ["m"]\nmax-num-seqs = 4\nprefix-caching = true\n'
    pieces = [b"[", b"]", b"{", b"}", b"=", b'"', b"'", b"\n", b"\xff", b"\xc3", b"\x00", b"#", b"1e999", b"nan",
              b"[[t]]", b"a.b.c = 1", b"-" * 50, b"\\u0000", b"0x7f", b"inf", b"true", b'"""']
    for i in range(200):
        raw = bytearray(base)
        for _ in range(rng.randint(1, 6)):
            at = rng.randrange(len(raw) + 1)
            if rng.random() < 0.5:
                raw[at:at] = rng.choice(pieces) * rng.choice([1, 1, 3, 600])
            else:
                del raw[at:at + rng.randint(1, 8)]
        path = tmp_path / f"fuzz{i}.toml"
        path.write_bytes(bytes(raw))
        capsys.readouterr()
        rc = main(["serve", "--config", str(path), "--model", str(tmp_path / "none")])
        err = capsys.readouterr().err
        assert rc in (1, 2) and "Traceback" not in err and err.count("\n") == 1, (bytes(raw)[:200], err[-400:])
