"""The test harness: real daemons on loopback (LocalDaemon), and the tiers the test files are sorted into."""
