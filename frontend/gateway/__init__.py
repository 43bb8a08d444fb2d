"""The HTTP/SSE gateway: OpenAI-compatible routes for browsers and web frontends, a gRPC client of the frontend."""
