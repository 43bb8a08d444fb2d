"""tokend's frontend process: the gRPC server and the HTTP/SSE gateway (built in the daemon issue)."""
