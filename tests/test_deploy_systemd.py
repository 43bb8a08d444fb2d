"""The systemd kit in deploy/systemd/: a unit systemd accepts and rates "OK" or better for exposure, the user and
directories it expects, and an example tokend.toml that is every option at its default."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import msgspec
import pytest
from daemon_harness import ROOT

from daemon.cli import build_parser
from daemon.config import ALL_OPTIONS, ModelSpec, ServeConfig, load_serve_config
from frontend.spec import TenantSpec

KIT = ROOT / "deploy" / "systemd"
UNIT = KIT / "tokend.service"
EXAMPLE_CONFIG = KIT / "tokend.toml"
ANALYZE = shutil.which("systemd-analyze")
needs_analyze = pytest.mark.skipif(ANALYZE is None, reason="systemd-analyze is not installed (Debian: systemd)")
# systemd-analyze security's badges: an exposure below 5.0 is "OK", below 1.0 "SAFE", 0.0 "PERFECT".
OK_OR_BETTER = ("OK", "SAFE", "PERFECT")
OK_THRESHOLD = 5.0


def unit_settings() -> dict[str, list[str]]:
    """Each Key= of the unit, with every value it is given (keys such as SystemCallFilter= repeat)."""
    settings: dict[str, list[str]] = {}
    for line in UNIT.read_text().splitlines():
        if "=" in line and not line.startswith(("#", "[")):
            key, value = line.split("=", 1)
            settings.setdefault(key.strip(), []).append(value.strip())
    return settings


def verify_complaints(unit_text: str, directory: Path) -> str:
    """What `systemd-analyze verify` says about a unit: nothing when systemd would load it as written."""
    # verify insists that ExecStart's binary exists: this checkout's `tokend` stands in for /opt/tokend's.
    tokend = Path(sys.executable).with_name("tokend")
    path = directory / "tokend.service"
    path.write_text(unit_text.replace("/opt/tokend/.venv/bin/tokend", str(tokend if tokend.exists() else "/bin/true")))
    result = subprocess.run([ANALYZE, "verify", "--man=no", str(path)], capture_output=True, text=True, timeout=120)
    # An unknown or misspelt directive is only a warning (exit 0): anything said at all is a finding.
    return (result.stdout + result.stderr).strip() or ("" if result.returncode == 0 else f"exit {result.returncode}")


@needs_analyze
def test_systemd_accepts_the_unit(tmp_path):
    assert verify_complaints(UNIT.read_text(), tmp_path) == ""


@needs_analyze
def test_verify_would_catch_a_misspelt_directive(tmp_path):
    misspelt = UNIT.read_text().replace("ProtectClock=", "ProtectClok=")
    assert "ProtectClok" in verify_complaints(misspelt, tmp_path)


@needs_analyze
def test_the_unit_rates_ok_or_better_for_exposure():
    result = subprocess.run(
        [ANALYZE, "security", "--offline=true", "--no-pager", str(UNIT)], capture_output=True, text=True, timeout=120
    )
    rating = re.search(r"Overall exposure level for tokend\.service: (\d+(?:\.\d+)?) (\w+)", result.stdout)
    assert rating, result.stdout + result.stderr
    score, badge = float(rating[1]), rating[2]
    assert score < OK_THRESHOLD and badge in OK_OR_BETTER, result.stdout


def test_the_unit_keeps_the_daemons_contract_with_systemd():
    settings = unit_settings()
    assert settings["Type"] == ["notify"] and settings["NotifyAccess"] == ["main"]  # READY=1 from `tokend serve`
    assert settings["RestartPreventExitStatus"] == ["78"]  # a configuration error is not retried
    assert settings["KillMode"] == ["mixed"]  # SIGTERM to the supervisor, which drains and reaps its children
    # systemd's SIGKILL must come after the drain has had its time.
    assert float(settings["TimeoutStopSec"][0]) > ServeConfig().drain_timeout
    assert float(settings["WatchdogSec"][0]) > ServeConfig().stall_timeout
    assert settings["ExecStart"][0].endswith(f"serve --config /etc/tokend/{EXAMPLE_CONFIG.name}")
    # GPUs stay reachable: PrivateDevices= would hide /dev/nvidia*, and the device allow list names them.
    assert "PrivateDevices" not in settings
    assert any(rule.startswith("char-nvidia") for rule in settings["DeviceAllow"])


@pytest.mark.skipif(
    not (shutil.which("systemd-sysusers") and shutil.which("systemd-tmpfiles")) or os.geteuid() != 0,
    reason="needs systemd-sysusers and systemd-tmpfiles (Debian: systemd), run as root to chown",
)
def test_sysusers_and_tmpfiles_make_the_user_and_directories_the_unit_expects(tmp_path):
    (tmp_path / "etc").mkdir()  # an empty root: sysusers writes its passwd and group there
    for command, conf in (
        (["systemd-sysusers"], "tokend.sysusers"),
        (["systemd-tmpfiles", "--create"], "tokend.tmpfiles"),
    ):
        result = subprocess.run([*command, f"--root={tmp_path}", str(KIT / conf)], capture_output=True, text=True)
        assert result.returncode == 0, result.stderr
    passwd = {line.split(":")[0]: line.split(":") for line in (tmp_path / "etc/passwd").read_text().splitlines()}
    name, _, uid, gid, _, home, shell = passwd["tokend"]
    assert (home, Path(shell).name) == ("/var/lib/tokend", "nologin")
    expected = {
        "etc/tokend": (0o750, 0, int(gid)),  # root writes the config, the daemon reads it, nobody else
        "var/lib/tokend": (0o700, int(uid), int(gid)),
        "var/cache/tokend": (0o700, int(uid), int(gid)),
    }
    for path, (mode, owner, group) in expected.items():
        status = (tmp_path / path).stat()
        assert (oct(status.st_mode & 0o7777), status.st_uid, status.st_gid) == (oct(mode), owner, group), path
    settings = unit_settings()  # the unit makes the same directories the same way at start
    assert settings["User"] == settings["Group"] == [name]
    assert settings["StateDirectoryMode"] == settings["CacheDirectoryMode"] == ["0700"]


# -- the example /etc/tokend/tokend.toml ----------------------------------------------------------------------------


def test_the_committed_example_config_is_what_the_script_prints_now():
    printed = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "example_config.py")], capture_output=True, text=True, check=True
    ).stdout
    assert EXAMPLE_CONFIG.read_text() == printed, (
        "deploy/systemd/tokend.toml is stale: .venv/bin/python scripts/example_config.py > deploy/systemd/tokend.toml"
    )


def test_the_example_config_names_every_option():
    text = EXAMPLE_CONFIG.read_text()
    listed = set(re.findall(r"(?m)^#(\w+) = ", text)) | set(re.findall(r"(?m)^# (\w+): unset by default", text))
    assert listed == {option.key for option in ALL_OPTIONS}


def test_the_example_config_loads_as_is_and_with_every_default_uncommented(tmp_path, monkeypatch):
    monkeypatch.setenv("STATE_DIRECTORY", "/var/lib/tokend")  # as under the unit, whose default state_dir it shows
    text = EXAMPLE_CONFIG.read_text()
    uncommented, count = re.subn(r"(?m)^#(?=\w+ = )", "", text)
    assert count > 0

    def load(content: str) -> ServeConfig:
        path = tmp_path / "tokend.toml"
        path.write_text(content)
        return load_serve_config(build_parser().parse_args(["serve", "--config", str(path)]), environ={})

    defaults = load("")
    assert load(text) == defaults
    assert load(uncommented) == defaults


def test_the_example_tables_are_ones_the_daemon_accepts():
    text = EXAMPLE_CONFIG.read_text()
    for table, spec_type in (("models", ModelSpec), ("tenants", TenantSpec)):
        block = re.search(rf"(?ms)^# \[\[{table}\]\]\n.*?(?=^$|\Z)", text)
        assert block, f"no [[{table}]] example"
        data = tomllib.loads(re.sub(r"(?m)^# ?", "", block[0]))
        example = msgspec.convert(data[table][0], spec_type)  # unknown or mistyped keys raise
        # Every field is shown, so that the example is also the tables' reference.
        assert set(data[table][0]) == set(msgspec.structs.asdict(example))
