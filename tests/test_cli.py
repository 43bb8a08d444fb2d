"""The `tokend` command line as a user meets it: help for every flag, --version, one name for the daemon's address,
`generate` keys (flag, file, environment) / `--chat` against a daemon with tenants, `gateway --host`, quiet output."""

from __future__ import annotations

import argparse
import hashlib
import importlib.metadata
import json
import os
import re
import subprocess
import sys
import tomllib
import urllib.request

import pytest
from daemon_harness import ROOT, Daemon, free_port

from daemon.cli import build_parser

API_KEY = "sk-cli-0123456789"


def _subcommands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    (commands,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    return dict(commands.choices)


def _tokend(*argv: str, env: dict[str, str] | None = None, timeout: float = 120) -> subprocess.CompletedProcess:
    environ = {**os.environ, "PYTHONPATH": str(ROOT)}
    environ.pop("TOKEND_API_KEY", None)  # only what the test gives
    environ.update(env or {})
    command = [sys.executable, "-m", "daemon.cli", *argv]
    return subprocess.run(command, capture_output=True, text=True, cwd=ROOT, env=environ, timeout=timeout)


# -- the parser ---------------------------------------------------------------------------------------------------


def _says_something(help_text: str | None) -> bool:
    return bool(re.sub(r"\(default: [^)]*\)", "", help_text or "").strip())


def test_every_command_option_and_argument_has_help():
    parser = build_parser()
    (commands,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    missing = [f"tokend {listed.dest}" for listed in commands._choices_actions if not _says_something(listed.help)]
    missing += [
        f"tokend {name} {'/'.join(action.option_strings) or action.dest}"
        for name, command in {"": parser, **_subcommands(parser)}.items()
        for action in command._actions
        if action is not commands and action.help != argparse.SUPPRESS and not _says_something(action.help)
    ]
    assert missing == []


def test_the_daemons_address_is_address_in_every_command_and_the_old_grpc_still_works():
    parser = build_parser()
    commands = _subcommands(parser)
    for name in ("gateway", "generate", "bench"):
        assert "--address HOST:PORT" in commands[name].format_help(), name
        assert "--grpc " not in commands[name].format_help(), name
    assert parser.parse_args(["gateway", "--grpc", "10.0.0.1:1"]).address == "10.0.0.1:1"
    assert parser.parse_args(["gateway", "--address", "10.0.0.1:2"]).address == "10.0.0.1:2"
    assert parser.parse_args(["bench", "--grpc", "10.0.0.1:3"]).address == "10.0.0.1:3"
    assert parser.parse_args(["bench", "--address", "10.0.0.1:4"]).address == "10.0.0.1:4"
    with pytest.raises(SystemExit):
        parser.parse_args(["bench", "--address", "a:1", "--base-url", "http://b"])


# -- --version ----------------------------------------------------------------------------------------------------


def test_version_is_the_installed_packages():
    expected = f"tokend {importlib.metadata.version('tokend')}\n"
    for argv in (["--version"], ["serve", "--version"]):
        result = _tokend(*argv)
        assert result.returncode == 0 and result.stdout == expected, result


def test_version_from_a_checkout_without_install_is_pyprojects():
    """-S: no site-packages, so no installed metadata; the checkout's pyproject.toml answers."""
    version = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
    code = "from daemon.version import tokend_version; print(tokend_version())"
    result = subprocess.run([sys.executable, "-S", "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert result.returncode == 0 and result.stdout.strip() == version, result


# -- against a daemon with tenants ----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def daemon(tmp_path_factory):
    config = tmp_path_factory.mktemp("cli") / "tokend.toml"
    config.write_text(f'[[tenants]]\nname = "cli"\napi_key_sha256 = "{hashlib.sha256(API_KEY.encode()).hexdigest()}"\n')
    with Daemon("--config", str(config)) as running:
        yield running


def _generate(daemon: Daemon, *flags: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return _tokend("generate", "--address", daemon.address, "--max-tokens", "4", *flags, env=env)


def test_generate_sends_the_api_key_from_the_flag_the_environment_or_a_file(daemon):
    refused = _generate(daemon, "Hello")
    assert refused.returncode == 1 and "UNAUTHENTICATED" in refused.stderr
    from_flag = _generate(daemon, "Hello", "--api-key", API_KEY)
    assert "--api-key-file" in from_flag.stderr and "argv" in from_flag.stderr  # it works, and says why not to
    from_env = _generate(daemon, "Hello", env={"TOKEND_API_KEY": API_KEY})
    key_file = os.path.join(daemon.state_dir, "cli-key")
    with open(key_file, "w") as file:
        file.write(API_KEY + "\n")
    from_file = _generate(daemon, "Hello", "--api-key-file", key_file)
    for result in (from_flag, from_env, from_file):
        assert result.returncode == 0, result.stderr
        assert "4 completion tokens" in result.stderr
        (request_id,) = re.findall(r"request_id=(\S+)\]", result.stderr)
        with daemon.ledger() as ledger:
            (row,) = ledger.execute("SELECT tenant FROM usage WHERE request_id = ?", (request_id,))
        assert row["tenant"] == "cli"


def test_generate_typed_while_the_daemon_starts_answers_once_the_model_serves():
    starting = Daemon()  # its ports chosen, nothing started yet
    command = [sys.executable, "-m", "daemon.cli", "generate", "--address", starting.address, "--max-tokens", "4",
               "--wait", "300", "Hello"]  # fmt: skip
    generate = subprocess.Popen(command, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}, text=True,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE)  # fmt: skip
    try:
        with starting:  # the command is already waiting, first for the port, then for the model
            _, stderr = generate.communicate(timeout=300)
    finally:
        generate.kill()
    assert generate.returncode == 0, stderr
    assert "4 completion tokens" in stderr


def test_generate_against_no_daemon_gives_up_after_its_wait_naming_the_flag():
    result = _tokend("generate", "--address", f"127.0.0.1:{free_port()}", "--wait", "1", "Hello")
    assert result.returncode == 1
    assert "no daemon listening at" in result.stderr and "after 1 s (--wait)" in result.stderr


def test_generate_chat_sends_one_user_message(daemon):
    result = _generate(daemon, "What is the capital of France?", "--chat", "--api-key", API_KEY)
    assert result.returncode == 0, result.stderr
    (request_id,) = re.findall(r"request_id=(\S+)\]", result.stderr)
    with daemon.ledger() as ledger:
        (row,) = ledger.execute("SELECT prompt_tokens FROM usage WHERE request_id = ?", (request_id,))
    # Rendered with the template: more tokens than the question itself (the byte-level tokenizer: one per byte).
    assert row["prompt_tokens"] > len("What is the capital of France?")


def test_the_gateway_alone_listens_on_its_host(daemon):
    port = free_port()
    command = [sys.executable, "-m", "daemon.cli", "gateway", "--address", daemon.address, "--host", "127.0.0.2",
               "--http-port", str(port)]  # fmt: skip
    gateway = subprocess.Popen(command, cwd=ROOT, stderr=subprocess.PIPE, text=True)
    try:
        daemon.wait_for(lambda: _answers(f"http://127.0.0.2:{port}/health"), timeout=60)
    finally:
        gateway.terminate()
        _, stderr = gateway.communicate(timeout=30)
    assert "gateway_beyond_loopback" not in stderr


def test_the_gateway_alone_warns_when_it_listens_beyond_loopback():
    # 192.0.2.1 (TEST-NET-1) is no address of this machine: the warning comes, then the bind fails, and nothing
    # is ever exposed.
    result = _tokend("gateway", "--host", "192.0.2.1", "--http-port", str(free_port()), timeout=60)
    first_line = json.loads(result.stderr.splitlines()[0])
    assert first_line["event"] == "gateway_beyond_loopback" and first_line["level"] == "warning"
    assert "[[tenants]]" in first_line["message"]
    assert result.returncode != 0


def _answers(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2) as reply:
            return reply.status == 200
    except OSError:
        return False


# -- quiet off a terminal -------------------------------------------------------------------------------------------


def test_offline_generate_piped_writes_no_progress_bars():
    result = _tokend("generate", "--offline", "--device", "cpu", "--max-tokens", "2", "Hello", timeout=300)
    assert result.returncode == 0, result.stderr
    assert "\r" not in result.stderr and "loading" not in result.stderr and "%|" not in result.stderr
    assert "tokens/s" in result.stdout
