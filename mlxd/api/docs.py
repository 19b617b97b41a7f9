"""``/docs``: Swagger UI that renders offline. Its script and stylesheet come from the ``swagger-ui-py`` wheel
(swagger-ui's dist files, installed with mlxd), its start-up script from ``mlxd/api/static``; the page loads
nothing from another origin and its CSP allows scripts from 'self' only.

The routes keep the default access (an API key when keys are configured), as ``/docs`` always had."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

from litestar import Request, Router, get
from litestar.exceptions import NotFoundException
from litestar.openapi import OpenAPIConfig
from litestar.openapi.plugins import OpenAPIRenderPlugin
from litestar.response import File

from mlxd.errors import MlxdError

DOCS_PATH = "/docs"
ASSETS = f"{DOCS_PATH}/assets"
_STATIC = Path(__file__).parent / "static"
_SELF, _NONE = "'self'", "'none'"
# Swagger UI sets style attributes from script, hence 'unsafe-inline' for styles (never for scripts).
_POLICY = (f"default-src {_NONE}", f"script-src {_SELF}", f"style-src {_SELF} 'unsafe-inline'",
           f"img-src {_SELF} data:", f"font-src {_SELF} data:", f"connect-src {_SELF}", f"base-uri {_NONE}",
           f"form-action {_SELF}", f"frame-ancestors {_NONE}")
HEADERS = {"Content-Security-Policy": "; ".join(_POLICY), "X-Content-Type-Options": "nosniff",
           "Referrer-Policy": "no-referrer"}


def _swagger_dist() -> Path:
    """The ``static`` folder of the installed ``swagger_ui`` package, found without importing it."""
    spec = importlib.util.find_spec("swagger_ui")
    if spec is None or not spec.submodule_search_locations:
        raise MlxdError("the swagger-ui-py package (/docs' assets) is missing: reinstall mlxd, which depends on it")
    return Path(next(iter(spec.submodule_search_locations))) / "static"


def _asset_files() -> dict[str, Path]:
    dist = _swagger_dist()
    return {"swagger-ui-bundle.js": dist / "swagger-ui-bundle.js", "swagger-ui.css": dist / "swagger-ui.css",
            "favicon.png": dist / "favicon-32x32.png", "docs-init.js": _STATIC / "docs-init.js"}


_MEDIA = {".js": "text/javascript", ".css": "text/css", ".png": "image/png"}  # Litestar adds the charset


class OfflineSwagger(OpenAPIRenderPlugin):
    """Swagger UI from local assets: the page holds no inline script (the spec is fetched by ``docs-init.js``).
    Litestar's own Swagger plugin loads its assets from a CDN; there is no OAuth2 here, so no redirect page."""

    def render(self, request: Request, openapi_schema: dict[str, Any]) -> bytes:
        title = _escape(str(openapi_schema["info"]["title"]))
        return f"""<!doctype html>
<html lang="en">
<head>
<meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>{title}</title>
<link rel="icon" type="image/png" href="{ASSETS}/favicon.png">
<link rel="stylesheet" href="{ASSETS}/swagger-ui.css">
<script src="{ASSETS}/swagger-ui-bundle.js"></script>
<script src="{ASSETS}/docs-init.js"></script>
</head>
<body>
<div id="swagger-ui" data-spec-url="{DOCS_PATH}/openapi.json"></div>
</body>
</html>
""".encode()


def _escape(text: str) -> str:
    return text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;").replace('"', "&quot;")


def make_docs_config(title: str, version: str) -> OpenAPIConfig:
    """The OpenAPI config: the document at ``/docs/openapi.json``, Swagger UI at ``/docs`` with its assets under
    ``/docs/assets/`` (only the files listed here are served)."""
    files = _asset_files()

    @get("/assets/{name:str}", sync_to_thread=False, include_in_schema=False)
    def asset(name: str) -> File:
        path = files.get(name)
        if path is None:
            raise NotFoundException(f"no asset {name!r} under {ASSETS}")
        return File(path, content_disposition_type="inline", media_type=_MEDIA[path.suffix],
                    headers={"Cache-Control": "public, max-age=86400"})

    router = Router(path=DOCS_PATH, route_handlers=[asset], response_headers=HEADERS, include_in_schema=False)
    return OpenAPIConfig(title=title, version=version, path=DOCS_PATH, openapi_router=router,
                         render_plugins=[OfflineSwagger(path="/")])
