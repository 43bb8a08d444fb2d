"""tokend's daemon: the command line and, later, the supervisor that systemd starts (`tokend serve`)."""
