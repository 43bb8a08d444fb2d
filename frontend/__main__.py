"""Entry point of the frontend process: `python -m frontend <FrontendSpec file>` (spawned by the daemon), or with the
spec's JSON itself in place of the file."""

from __future__ import annotations

import sys

import uvloop

from common.child_process import become_child
from common.exit_codes import EXIT_CONFIG_ERROR
from common.logs import configure_logging
from frontend.server import PortInUse, serve
from frontend.spec import FrontendSpec, spec_text


def main(argv: list[str]) -> int:
    spec = FrontendSpec.from_json(spec_text(argv[1]))
    become_child("tokend: frontend")
    log = configure_logging("frontend", spec.log_level)
    try:
        uvloop.run(serve(spec, log))
    except PortInUse as error:
        log.error("cannot_listen", error=str(error))
        return EXIT_CONFIG_ERROR  # never a restart loop: the port stays taken until someone acts
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
