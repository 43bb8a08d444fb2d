"""The chaos run's parts: fuzzers per surface, canaries, background load, fault injection and the ledger audit."""
