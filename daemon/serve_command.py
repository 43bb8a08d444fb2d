"""`tokend serve`: reads the configuration and runs the supervisor until SIGTERM."""

from __future__ import annotations

import argparse
import sys

from common.exit_codes import EXIT_CONFIG_ERROR
from common.logs import configure_logging
from daemon.config import load_serve_config


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
    import setproctitle

    from daemon.supervisor import Supervisor

    setproctitle.setproctitle("tokend: serve")
    log = configure_logging("daemon", config.log_level)
    return Supervisor(config, log, reload_config=lambda: load_serve_config(args)).run()
