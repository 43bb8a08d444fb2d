"""Judges one HTTP answer to a fuzzed request: a documented refusal, a success, or a loss (5xx, hang, nonsense)."""

from __future__ import annotations

import json

from chaos.http_wire import HttpAnswer
from chaos.report import Outcome


def judge(answer: HttpAnswer, closing_ok: bool = False) -> Outcome:
    """closing_ok: the request was ill-framed on purpose and our side was shut, so a server that just closes the
    connection answered as well as HTTP allows."""
    if answer.status is None:
        if answer.error == "timeout":
            return Outcome("no answer (timeout)", "hung", f"no answer within {answer.elapsed_s:.1f} s")
        if closing_ok:
            return Outcome("closed without answer (ill-framed)")
        return Outcome("closed without answer", "bad_answers", answer.error)
    status, body = answer.status, answer.body
    if status >= 500:
        return Outcome(str(status), "five_xx", f"{status} {answer.content_type}: {body[:300].decode(errors='replace')}")
    if 400 <= status < 500:
        if _is_openai_error(answer.json()):
            return Outcome(str(status))
        # uvicorn refuses bad HTTP framing itself, in plain text, before the application sees the request.
        return Outcome(f"{status} not in OpenAI's shape ({answer.content_type or 'no content-type'})")
    if status == 200:
        return _judge_success(answer)
    if status in (301, 302, 307, 308):  # e.g. Starlette's redirect of a trailing slash
        return Outcome(f"{status} redirect")
    return Outcome(str(status), "bad_answers", f"unexpected status {status}: {body[:200]!r}")


def _judge_success(answer: HttpAnswer) -> Outcome:
    if answer.content_type.startswith("text/event-stream"):
        try:
            event = json.loads(answer.body)
        except ValueError:
            return Outcome("200 stream, bad first event", "bad_answers", repr(answer.body[:200]))
        if isinstance(event, dict) and _is_openai_error(event):
            return Outcome("200 stream, error event")
        if isinstance(event, dict) and "choices" in event:
            return Outcome("200 stream")
        return Outcome("200 stream, bad first event", "bad_answers", repr(answer.body[:200]))
    body = answer.json()
    if isinstance(body, dict) and ("choices" in body or "data" in body or "status" in body):
        return Outcome("200")
    return Outcome("200, bad body", "bad_answers", repr(answer.body[:200]))


def _is_openai_error(body: object) -> bool:
    return isinstance(body, dict) and isinstance(body.get("error"), dict) and "message" in body["error"]
