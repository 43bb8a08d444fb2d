"""Exit statuses every tokend process shares (sysexits.h values, which systemd units can match on)."""

EXIT_CANNOT_SERVE = 1  # the daemon gave up on a child that kept failing: systemd may restart it all
EXIT_TEMPORARY = 75  # EX_TEMPFAIL: e.g. a port still held by a previous instance; a later start may work
EXIT_CONFIG_ERROR = 78  # EX_CONFIG: the configuration is wrong; restarting cannot help (RestartPreventExitStatus)
