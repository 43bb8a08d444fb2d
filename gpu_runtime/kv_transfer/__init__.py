"""KV pages handed from prefill workers to decode workers (disaggregated serving): leases, the pull protocol, and
its transports (transport.py: ZeroMQ frames, NIXL)."""
