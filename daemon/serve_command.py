"""`tokend serve`: reads the configuration and runs the supervisor until SIGTERM."""

from __future__ import annotations

import argparse
import sys

from common.exit_codes import EXIT_CONFIG_ERROR
from common.logs import configure_logging
from daemon.config import load_serve_config
from daemon.config_checks import readable_by_others


def warn_if_readable_by_others(log, files: dict[str, str]) -> None:
    """A config or tenant file others may read: it holds key hashes (offline guessing) and the layout."""
    for key, path, mode in readable_by_others(files):
        log.warning(
            "file_readable_by_others",
            key=key,
            path=path,
            mode=mode,
            detail=f"its group or every user may read it (it holds key hashes); chmod 600 {path}",
        )


def run_serve(args: argparse.Namespace) -> int:
    try:
        config = load_serve_config(args)
    except (ValueError, TypeError) as error:
        print(f"tokend serve: {error}", file=sys.stderr)
        return EXIT_CONFIG_ERROR
    from daemon.listeners import first_unavailable, listeners_of

    unavailable = first_unavailable(listeners_of(config))
    if unavailable:  # before any model load: a port someone else holds is the operator's to free
        print(f"tokend serve: {unavailable}", file=sys.stderr)
        return EXIT_CONFIG_ERROR
    from daemon.supervisor import Supervisor, runtime_parent_problem

    if problem := runtime_parent_problem():
        print(f"tokend serve: {problem}", file=sys.stderr)
        return EXIT_CONFIG_ERROR
    import setproctitle

    setproctitle.setproctitle("tokend: serve")
    log = configure_logging("daemon", config.log_level)
    warn_if_readable_by_others(log, {"config": str(args.config or ""), "tenants_file": config.tenants_file})
    return Supervisor(config, log, reload_config=lambda: load_serve_config(args)).run()
