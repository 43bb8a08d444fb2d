"""Exit statuses every tokend process shares (sysexits.h values, which systemd units can match on)."""

EXIT_CANNOT_SERVE = 1  # the daemon gave up on a child that kept failing: systemd may restart it all
# EX_CONFIG: the configuration is wrong and restarting cannot help (the unit's RestartPreventExitStatus). A
# listener's port held by another process is one too: only the operator can free it or pick another.
EXIT_CONFIG_ERROR = 78
