"""The installed `jaxspec` command (jaxspec/cli.py): its help, its errors for bad input, and a real generation."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest

from jaxspec import cli

# `make install` installs the package editable, console script included; without it the module is the command.
COMMAND = [shutil.which("jaxspec")] if shutil.which("jaxspec") else [sys.executable, "-m", "jaxspec.cli"]


def jaxspec(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([*COMMAND, *args], capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, "JAX_PLATFORMS": "cpu"})


def test_help_lists_every_subcommand():
    out = jaxspec("--help")
    assert out.returncode == 0, out.stderr
    for name in cli.COMMANDS:
        assert name in out.stdout
    assert out.stdout.startswith("usage: jaxspec")


@pytest.mark.parametrize("args, expected", [
    (("generate", "--help"), ["usage: jaxspec generate", "--max-new-tokens", "--method", "--chat", "--seed"]),
    (("corpus", "--help"), ["usage: jaxspec corpus", "--prompts", "--texts", "--out", "--model"]),
    (("train", "--help"), ["usage: jaxspec train", "eagle3", "medusa", "dflash"]),
    (("train", "medusa", "--help"), ["--steps", "--ship"]),
    (("serve", "--help"), ["usage: jaxspec serve", "--port", "--method"]),
])
def test_each_subcommand_has_help(args, expected):
    out = jaxspec(*args)
    assert out.returncode == 0, out.stderr
    for text in expected:
        assert text in out.stdout, (text, out.stdout[:400])


@pytest.mark.parametrize("args, message", [
    (("generate", "--bogus", "x"), "unrecognized arguments: --bogus"),
    (("generate", "--method", "warp", "x"), "--method/--spec: invalid choice: 'warp'"),
    (("generate", "--max-new-tokens", "0", "x"), "--max-new-tokens 0 must be >= 1"),
    (("generate", "--seed", "-1", "x"), "seed=-1 must be an integer"),
    (("frobnicate",), "invalid choice: 'frobnicate'"),
    ((), "the following arguments are required: COMMAND"),
    (("train", "lora"), "argument kind: invalid choice: 'lora'"),
    (("corpus", "--out", "c.json"), "nothing to build from: give --prompts FILE and/or --texts FILE"),
    (("corpus", "--out", "c.json", "--prompts", "/nonexistent/prompts.txt"), "'/nonexistent/prompts.txt' cannot"),
])
def test_bad_input_exits_2_naming_it(args, message, capsys):
    with pytest.raises(SystemExit) as exit_info:  # argparse's error: usage and message on stderr, status 2
        cli.main(list(args))
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


def test_the_installed_command_exits_2_naming_a_bad_flag():
    out = jaxspec("generate", "--max-tokens", "4", "def f(x):")
    assert out.returncode == 2, (out.returncode, out.stderr)
    assert "jaxspec generate: error: unrecognized arguments: --max-tokens" in out.stderr
    assert "Traceback" not in out.stderr


def test_corpus_inputs_are_read_one_per_line_or_as_jsonl(tmp_path):
    from jaxspec.train.sam_corpus import read_items

    (tmp_path / "p.txt").write_text("first prompt\n\nsecond prompt\n")
    assert read_items(tmp_path / "p.txt", field="prompt", whole=False) == ["first prompt", "second prompt"]
    assert read_items(tmp_path / "p.txt", field="text", whole=True) == ["first prompt\n\nsecond prompt\n"]
    (tmp_path / "p.jsonl").write_text('"def f(x):\\n"\n{"prompt": "class A:\\n"}\n')
    assert read_items(tmp_path / "p.jsonl", field="prompt", whole=False) == ["def f(x):\n", "class A:\n"]
    (tmp_path / "bad.jsonl").write_text('{"text": 3}\n')
    with pytest.raises(ValueError, match="line 1 must be a non-empty JSON string or an object with a non-empty "
                                         "'prompt' string"):
        read_items(tmp_path / "bad.jsonl", field="prompt", whole=False)
    (tmp_path / "empty.txt").write_text("\n\n")
    with pytest.raises(ValueError, match="holds no prompts"):
        read_items(tmp_path / "empty.txt", field="prompt", whole=False)


def test_enable_compilation_cache_sets_the_folder(tmp_path, monkeypatch):
    import jax

    import jaxspec

    monkeypatch.setattr(jax.config, "update", lambda name, value: calls.append((name, value)))
    calls: list = []
    assert jaxspec.enable_compilation_cache(tmp_path / "xla") == tmp_path / "xla"
    assert (tmp_path / "xla").is_dir() and ("jax_compilation_cache_dir", str(tmp_path / "xla")) in calls
    (tmp_path / "file").write_text("")
    with pytest.raises(ValueError, match="must be a folder"):
        jaxspec.enable_compilation_cache(tmp_path / "file")


@pytest.mark.real_model
@pytest.mark.usefixtures("default_model_installed")
def test_generate_prints_the_default_models_text():
    out = jaxspec("generate", "--max-new-tokens", "4", "def f(x):", timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("def f(x):") and len(out.stdout.strip()) > len("def f(x):")
    assert "4 tokens" in out.stderr or "finish:" in out.stderr
