"""`serve`'s chat page at `/`: static files in the package (clover_gguf/serve/static), no build step and nothing
fetched from elsewhere, so it works offline. The page reads only the API (/v1/models, /v1/chat/completions with
clover_blocks); it is served without the API key (a browser cannot send one when it opens a URL) and asks for the
key itself. Every response carries a Content-Security-Policy that allows only this origin's own scripts and styles:
the page builds its DOM from text, and the policy is the second line should anything ever be parsed as HTML."""

from __future__ import annotations

from importlib import resources

# URL path -> (file in static/, media type)
PAGE_FILES = {
    "/": ("index.html", "text/html; charset=utf-8"),
    "/static/app.js": ("app.js", "text/javascript; charset=utf-8"),
    "/static/markdown.js": ("markdown.js", "text/javascript; charset=utf-8"),
    "/static/style.css": ("style.css", "text/css; charset=utf-8"),
    "/static/icon.svg": ("icon.svg", "image/svg+xml"),
}
PAGE_PATHS = frozenset(PAGE_FILES)

HEADERS = {
    "Content-Security-Policy": "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self'; "
                               "connect-src 'self'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-cache",  # small files; a new version is seen at once
}


def read(name: str) -> bytes:
    return resources.files("clover_gguf.serve").joinpath("static", name).read_bytes()


def _handler(body: bytes, media: str):
    from starlette.responses import Response

    async def page_file() -> Response:
        return Response(body, media_type=media, headers=HEADERS)

    return page_file


def add_page_routes(app) -> None:
    """GET / and the page's files, read once when the app is made."""
    for path, (name, media) in PAGE_FILES.items():
        app.add_api_route(path, _handler(read(name), media), methods=["GET", "HEAD"], include_in_schema=False)
