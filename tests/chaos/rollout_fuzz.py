"""Admin.Rollout aimed off the allowed weights: no or wrong credential, relative paths, paths outside model_roots,
symlinks and `..` out of them, a malformed GGUF file: each refused with its code, and nothing rolled out."""

from __future__ import annotations

import os
import secrets
from dataclasses import dataclass
from pathlib import Path

import grpc
from hypothesis import strategies as st

from chaos.report import Outcome
from daemon.admin_token import read_admin_token
from tokend.v1 import tokend_pb2 as pb
from tokend.v1 import tokend_pb2_grpc as pb_grpc

_G = grpc.StatusCode


@dataclass(frozen=True, slots=True)
class Roots:
    roots: Path  # the daemon's model_roots
    outside: Path  # a real checkpoint beside them, outside
    link_out: Path  # a symlink in the roots to `outside`
    malformed_gguf: Path  # a GGUF file in the roots whose tensor count is 2^40


def make_roots(directory: Path) -> Roots:
    """The files the rollout surface aims at, under `directory` (made once; the same paths on later calls)."""
    roots, outside = directory / "roots", directory / "outside" / "C"
    made = Roots(roots, outside, roots / "link-out", roots / "bad" / "model.gguf")
    if not roots.exists():
        outside.mkdir(parents=True)
        (outside / "config.json").write_text("{}")
        made.malformed_gguf.parent.mkdir(parents=True)
        made.malformed_gguf.write_bytes(b"GGUF" + (3).to_bytes(4, "little") + (1 << 40).to_bytes(8, "little") * 2)
        os.symlink(outside, made.link_out)
    return made


# case -> (credential: admin | none | wrong | tenant, the codes it may end with)
CASES = {
    "no credential": ("none", {_G.UNAUTHENTICATED}),
    "wrong credential": ("wrong", {_G.UNAUTHENTICATED, _G.PERMISSION_DENIED}),
    "a tenant that is not an admin": ("tenant", {_G.PERMISSION_DENIED}),
    "relative path": ("admin", {_G.INVALID_ARGUMENT}),
    "outside model_roots": ("admin", {_G.FAILED_PRECONDITION}),
    "symlink out of the roots": ("admin", {_G.FAILED_PRECONDITION}),
    "dot-dot out of the roots": ("admin", {_G.FAILED_PRECONDITION}),
    "missing under the roots": ("admin", {_G.INVALID_ARGUMENT}),
    "unknown model": ("admin", {_G.NOT_FOUND}),
    # No spare group: refused before any load (with one, the load would fail and the old weights keep serving).
    "malformed GGUF under the roots": ("admin", {_G.FAILED_PRECONDITION, _G.INVALID_ARGUMENT}),
}
# A case, a word to vary it with (so that hypothesis never runs out of distinct values), a strategy to ask for.
rollout_case = st.tuples(
    st.sampled_from(sorted(CASES)),
    st.text("abcdefxyz0123456789-_", min_size=1, max_size=12),
    st.sampled_from(["", "surge", "in-place"]),
)


class RolloutProbe:
    """Sends one case and judges it; then checks that GetRollout still says what it said before the run."""

    def __init__(self, address: str, state_dir: str, roots: Roots, tenant_key: str, timeout: float):
        self._channel = grpc.insecure_channel(address)
        self._stub = pb_grpc.AdminStub(self._channel)
        self._admin_token = read_admin_token(state_dir)
        self._roots, self._tenant_key, self._timeout = roots, tenant_key, timeout
        try:
            self.baseline: list[tuple] | None = self._rollouts()
        except grpc.RpcError:  # each input then says why it was not sent
            self.baseline = None
        self.model = self.baseline[0][0] if self.baseline else "tokend-tiny-random"

    def close(self) -> None:
        self._channel.close()

    def _metadata(self, credential: str) -> tuple[tuple[str, str], ...]:
        token = {"admin": self._admin_token, "wrong": secrets.token_hex(16), "tenant": self._tenant_key}.get(credential)
        return (("authorization", f"Bearer {token}"),) if token else ()

    def _rollouts(self) -> list[tuple]:
        reply = self._stub.GetRollout(pb.GetRolloutRequest(), metadata=self._metadata("admin"), timeout=self._timeout)
        return [(r.model, r.phase, r.path, r.epoch) for r in reply.rollouts]

    def _path(self, case: str, word: str) -> str:
        r = self._roots
        return {
            "relative path": f"models/{word}",
            "outside model_roots": str(r.outside),
            "symlink out of the roots": str(r.link_out),
            "dot-dot out of the roots": f"{r.roots}/../outside/C",
            "missing under the roots": f"{r.roots}/missing-{word}",
            "malformed GGUF under the roots": str(r.malformed_gguf),
        }.get(case, str(r.outside))

    def send(self, value: tuple[str, str, str]) -> Outcome:
        case, word, strategy = value
        credential, expected = CASES[case]
        if self.baseline is None or (credential == "admin" and not self._admin_token):
            return Outcome("not sent: no local admin token to read, or GetRollout refused it")
        strategy = "surge" if case.startswith("malformed") else strategy
        model = f"nope-{word}" if case == "unknown model" else self.model
        request = pb.RolloutRequest(model=model, path=self._path(case, word), strategy=strategy)
        try:
            self._stub.Rollout(request, metadata=self._metadata(credential), timeout=self._timeout)
            code, details = _G.OK, ""
        except grpc.RpcError as error:
            code, details = error.code(), error.details() or ""
        return self._judge(case, code, details, expected)

    def _judge(self, case: str, code: grpc.StatusCode, details: str, expected: set) -> Outcome:
        label = f"refused {code.name}" if code in expected else f"{code.name} ({case})"
        if code == _G.OK:
            return Outcome(label, "not_refused", f"{case}: accepted")
        if code in (_G.INTERNAL, _G.UNKNOWN):
            return Outcome(label, "grpc_internal", details)
        if code == _G.DEADLINE_EXCEEDED:
            return Outcome(label, "hung", details)
        if code not in expected:
            return Outcome(label, "bad_answers", f"{case}: expected {sorted(c.name for c in expected)}: {details}")
        now = self._rollouts()
        if now != self.baseline:
            return Outcome("refused, yet rolled out", "not_refused", f"{case}: GetRollout {self.baseline} -> {now}")
        return Outcome(label)
