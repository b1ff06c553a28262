"""The web page: the static files beside this module, served at / and /ui/<file>.

Served under a policy that runs only the page's own script and style (no inline script, no eval) and talks
only to this origin. Loading the page needs no key: every API call it makes sends one.
"""

from functools import cache
from pathlib import Path

from fastapi import APIRouter, Request
from fastapi.responses import RedirectResponse, Response

from ..errors import APIError, error

WEB = Path(__file__).resolve().parent
PAGE_FILES = {"index.html": "text/html; charset=utf-8", "app.js": "text/javascript; charset=utf-8",
              "app.css": "text/css; charset=utf-8"}
PAGE_HEADERS = {
    "Content-Security-Policy": "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
                               "connect-src 'self'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'",
    "X-Content-Type-Options": "nosniff", "Referrer-Policy": "no-referrer", "Cache-Control": "no-cache"}

router = APIRouter(include_in_schema=False)


@cache
def _read(name: str) -> bytes:
    return (WEB / name).read_bytes()


def page_file(name: str) -> Response:
    if name not in PAGE_FILES:
        raise APIError(error(f"no page file {name!r}", "not_found_error"))
    return Response(_read(name), media_type=PAGE_FILES[name], headers=PAGE_HEADERS)


@router.get("/")
async def index(request: Request):
    path = request.url.path
    if not path.endswith("/"):      # under a route prefix: the page's relative links need the slash
        return RedirectResponse(path + "/" + (f"?{request.url.query}" if request.url.query else ""), 308)
    return page_file("index.html")


@router.get("/ui/{name}")
async def page_asset(name: str):
    return page_file(name)
