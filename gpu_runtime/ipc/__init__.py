"""The typed ZeroMQ link between the frontend and the scheduler processes (msgspec, never pickle)."""
