"""The playground's page (GET /) and its scripts and styles (GET /static/...), with the headers a production page
carries: a Content-Security-Policy that allows nothing but this origin's own files (no inline script or style, no
external asset: the page works offline), no MIME sniffing, no referrer, and no framing by another site."""

from __future__ import annotations

from pathlib import Path

from starlette.responses import FileResponse, Response
from starlette.staticfiles import StaticFiles

STATIC_DIR = Path(__file__).parent / "static"
PAGE = STATIC_DIR / "playground.html"

CONTENT_SECURITY_POLICY = "; ".join(
    [
        "default-src 'none'",
        "script-src 'self'",
        "style-src 'self'",
        "connect-src 'self'",  # the page's fetch() calls: this gateway's API, nothing else
        "img-src 'self' data:",  # data: for the empty favicon, which spares a request that would 404
        "base-uri 'none'",
        "form-action 'none'",
        "frame-ancestors 'none'",
        # The scripts never turn strings into HTML (they build DOM nodes and set textContent), and this makes the
        # browser refuse any that would: model output and API errors cannot become markup.
        "require-trusted-types-for 'script'",
        "trusted-types 'none'",
    ]
)
SECURITY_HEADERS = {
    "Content-Security-Policy": CONTENT_SECURITY_POLICY,
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "X-Frame-Options": "DENY",  # frame-ancestors for browsers that predate it
    "Cross-Origin-Opener-Policy": "same-origin",
    "Cache-Control": "no-cache",  # revalidate (a cheap 304): after an upgrade the page and its scripts match
}


def page_response() -> Response:
    return FileResponse(PAGE, media_type="text/html", headers=SECURITY_HEADERS)


class PlaygroundAssets(StaticFiles):
    """The page's .js and .css files, with the same headers as the page."""

    def file_response(self, *args, **kwargs) -> Response:
        response = super().file_response(*args, **kwargs)
        response.headers.update(SECURITY_HEADERS)
        return response
