"""The usage ledger: one SQLite row per request, written by one thread in small WAL transactions.

A finished request's row is committed before its last chunk goes out, so a frontend killed at any moment has
lost no record a client saw complete. Rows of requests still running are checkpointed every second with their
counts so far; a frontend that starts finds its predecessor's leftovers and marks them interrupted.
"""

from __future__ import annotations

import asyncio
import queue
import sqlite3
import threading
import time
from dataclasses import astuple, dataclass
from pathlib import Path

_SCHEMA = """
CREATE TABLE IF NOT EXISTS usage (
    record_id TEXT PRIMARY KEY,
    request_id TEXT NOT NULL,
    tenant TEXT NOT NULL,              -- '' while authentication is off
    model TEXT NOT NULL,
    priority TEXT NOT NULL,            -- interactive | batch
    status TEXT NOT NULL,              -- running | finished | cancelled | error | shed | interrupted
    prompt_tokens INTEGER NOT NULL,
    completion_tokens INTEGER NOT NULL,
    cached_tokens INTEGER NOT NULL,
    started_at REAL NOT NULL,          -- unix seconds
    updated_at REAL NOT NULL,
    finished_at REAL,
    generation TEXT NOT NULL DEFAULT ''  -- the weights that produced its tokens (the last ones, if it migrated)
);
CREATE INDEX IF NOT EXISTS usage_started_at ON usage (started_at);
"""
_UPSERT = """
INSERT INTO usage VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)
ON CONFLICT (record_id) DO UPDATE SET
    status = excluded.status, prompt_tokens = excluded.prompt_tokens,
    completion_tokens = excluded.completion_tokens, cached_tokens = excluded.cached_tokens,
    updated_at = excluded.updated_at, finished_at = excluded.finished_at, generation = excluded.generation
"""
# Only rows a dead frontend left: a live request's counts are never overwritten from outside its own stream.
_SETTLE_INTERRUPTED = """
UPDATE usage SET prompt_tokens = ?, completion_tokens = ?, cached_tokens = ?, updated_at = ?
WHERE record_id = ? AND status = 'interrupted'
"""
LEDGER_FILE = "usage.sqlite3"


@dataclass(slots=True)
class UsageRecord:
    record_id: str
    request_id: str
    tenant: str
    model: str
    priority: str
    status: str
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    started_at: float
    updated_at: float
    finished_at: float | None = None
    generation: str = ""


@dataclass(frozen=True, slots=True)
class _InterruptedCounts:
    record_id: str
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int

    def row(self) -> tuple:
        return (self.prompt_tokens, self.completion_tokens, self.cached_tokens, time.time(), self.record_id)


class UsageLedger:
    """Owns the database through one writer thread; callers on the event loop never block on SQLite."""

    def __init__(self, state_dir: str | Path, log):
        self.path = Path(state_dir) / LEDGER_FILE
        self._log = log
        self._queue: queue.Queue = queue.Queue()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._write_forever, name="usage-ledger", daemon=True)
        self._thread.start()
        self._ready.wait()

    async def commit(self, record: UsageRecord) -> None:
        """Writes the record and returns once it is committed (a crash after this cannot lose it)."""
        loop = asyncio.get_running_loop()
        done = loop.create_future()
        self._queue.put((_copy(record), loop, done))
        await done

    def checkpoint(self, records: list[UsageRecord]) -> None:
        """Writes the records soon, without waiting (progress of running requests)."""
        for record in records:
            self._queue.put((_copy(record), None, None))

    def settle_interrupted(
        self, record_id: str, prompt_tokens: int, completion_tokens: int, cached_tokens: int
    ) -> None:
        """Writes the final counts of an interrupted request soon, as its scheduler reported them."""
        self._queue.put((_InterruptedCounts(record_id, prompt_tokens, completion_tokens, cached_tokens), None, None))

    def close(self) -> None:
        self._queue.put(None)
        self._thread.join(timeout=10)

    def _write_forever(self) -> None:
        connection = connect(self.path)
        interrupted = connection.execute(
            "UPDATE usage SET status = 'interrupted', finished_at = updated_at WHERE status = 'running'"
        ).rowcount
        connection.commit()
        if interrupted:
            self._log.warning("usage_interrupted", records=interrupted)
        self._ready.set()
        stopping = False
        while not stopping:
            batch = [self._queue.get()]
            while not self._queue.empty():  # everything that queued meanwhile goes in the same transaction
                batch.append(self._queue.get_nowait())
            stopping = None in batch
            writes = [item for item in batch if item is not None]
            with connection:
                records = [astuple(item) for item, _, _ in writes if isinstance(item, UsageRecord)]
                connection.executemany(_UPSERT, records)
                settled = [item.row() for item, _, _ in writes if isinstance(item, _InterruptedCounts)]
                connection.executemany(_SETTLE_INTERRUPTED, settled)
            for _, loop, done in writes:
                if done is not None:
                    loop.call_soon_threadsafe(_resolve, done)
        connection.close()


def connect(path: Path, read_only: bool = False) -> sqlite3.Connection:
    if read_only:
        return sqlite3.connect(f"file:{path}?mode=ro", uri=True)
    path.parent.mkdir(parents=True, exist_ok=True)
    connection = sqlite3.connect(path)
    connection.execute("PRAGMA journal_mode=WAL")
    # NORMAL in WAL mode: a commit survives the process being killed (not a power cut), without an fsync each.
    connection.execute("PRAGMA synchronous=NORMAL")
    connection.executescript(_SCHEMA)
    columns = {row[1] for row in connection.execute("PRAGMA table_info(usage)")}
    if "generation" not in columns:  # a ledger from before rollouts: its rows keep generation ''
        connection.execute("ALTER TABLE usage ADD COLUMN generation TEXT NOT NULL DEFAULT ''")
        connection.commit()
    return connection


def summarize(connection: sqlite3.Connection, since: float = 0.0) -> dict[str, dict[str, int]]:
    """Totals per tenant for requests started at or after `since` (unix seconds). A shed request is in the
    ledger (status shed, nothing computed) but is not one of the tenant's requests: it was never admitted."""
    rows = connection.execute(
        """
        SELECT tenant, SUM(status != 'shed'), SUM(prompt_tokens), SUM(completion_tokens), SUM(cached_tokens),
               SUM(status = 'cancelled')
        FROM usage WHERE started_at >= ? GROUP BY tenant ORDER BY tenant
        """,
        (since,),
    ).fetchall()
    keys = ("requests", "prompt_tokens", "completion_tokens", "cached_tokens", "cancelled")
    return {tenant: dict(zip(keys, map(int, values), strict=True)) for tenant, *values in rows}


def _copy(record: UsageRecord) -> UsageRecord:
    return UsageRecord(*astuple(record))


def _resolve(done: asyncio.Future) -> None:
    if not done.done():
        done.set_result(None)
