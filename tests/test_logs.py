"""The daemon's log is one JSON object per line even when all its processes write to it at once."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# Each writer logs as fast as it can, the way a scheduler and the frontend do under load.
WRITER = """
import sys
from common.logs import configure_logging
log = configure_logging(sys.argv[1])
for index in range(int(sys.argv[2])):
    log.info("request_admitted", request_id=f"{sys.argv[1]}-{index}", prompt_tokens=index)
"""


def test_processes_sharing_one_log_file_never_splice_their_lines(tmp_path):
    lines_each, writers = 20000, ("frontend", "scheduler", "gateway")
    log_path = tmp_path / "daemon.log"
    with log_path.open("wb") as log:  # as the daemon's children share its stderr: one open file, no O_APPEND
        processes = [
            subprocess.Popen([sys.executable, "-c", WRITER, name, str(lines_each)], cwd=ROOT, stderr=log)
            for name in writers
        ]
        for process in processes:
            assert process.wait(timeout=120) == 0
    entries = [json.loads(line) for line in log_path.read_text().splitlines()]
    for name in writers:
        ids = [entry["request_id"] for entry in entries if entry["process"] == name]
        assert ids == [f"{name}-{index}" for index in range(lines_each)]
