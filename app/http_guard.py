"""`nanochat serve`'s guard against web pages. A page open in the user's browser may send requests to a server on
this machine (a form's POST needs no permission from the server) and, by rebinding its own domain name to
127.0.0.1, read the answers; with no --api-key, that is the model and the stored responses for any site the user
visits. So, as Ollama's server does:

- a request whose `Origin` (what browsers add to a page's requests) is not allowed is refused with 403 before
  it reaches the API; pages served from this machine (http(s)://localhost, 127.0.0.1, [::1], any port) are
  allowed, and so are the origins given with --allowed-origins ("*": any);
- a server listening on loopback without --api-key refuses a request whose `Host` is not a loopback name (a
  rebound domain's requests carry that domain; with a key, such a page cannot use the server anyway, and a
  reverse proxy in front of it may pass its own names);
- an allowed origin gets CORS headers, preflights (OPTIONS) answered here, so local web apps can use the API.

Requests without an Origin (curl, the SDKs, editors and agents) pass as before.
"""

from __future__ import annotations

import ipaddress
import json
from urllib.parse import urlsplit

# What a browser may send with a cross-origin request here: the headers the APIs read, and the SDKs' own.
ALLOWED_HEADERS = "Authorization, Content-Type, X-Api-Key, Anthropic-Version, Anthropic-Beta, OpenAI-Beta, " \
                  "X-Stainless-Lang, X-Stainless-Package-Version, X-Stainless-OS, X-Stainless-Arch, " \
                  "X-Stainless-Runtime, X-Stainless-Runtime-Version, X-Stainless-Retry-Count, X-Stainless-Timeout"
ALLOWED_METHODS = "GET, POST, DELETE, OPTIONS"


def is_loopback_name(name: str | None) -> bool:
    """Whether a host name (no port; an IPv6 address without brackets) names this machine's loopback."""
    if not name:
        return False
    name = name.lower().rstrip(".")
    if name == "localhost" or name.endswith(".localhost"):
        return True
    try:
        return ipaddress.ip_address(name).is_loopback
    except ValueError:
        return False


def host_of(header: str) -> str | None:
    """The name in a Host header ("127.0.0.1:8000", "[::1]:8000", "localhost")."""
    try:
        return urlsplit(f"//{header}").hostname
    except ValueError:
        return None


class Guard:
    """ASGI middleware: the checks and CORS headers above, in front of `app`."""

    def __init__(self, app, allowed_origins: tuple[str, ...] = (), check_host: bool = True):
        self.app = app
        self.any_origin = "*" in allowed_origins
        self.origins = {o.rstrip("/").lower() for o in allowed_origins if o != "*"}
        self.check_host = check_host

    def origin_allowed(self, origin: str) -> bool:
        if self.any_origin or origin.rstrip("/").lower() in self.origins:
            return True
        try:
            parts = urlsplit(origin)
        except ValueError:
            return False
        return parts.scheme in ("http", "https") and is_loopback_name(parts.hostname)

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        host = headers.get("host")
        if self.check_host and host is not None and not is_loopback_name(host_of(host)):
            return await refuse(send, f"the Host header {json.dumps(host)[:80]} is not a loopback name: a server on "
                                      "loopback without --api-key answers requests for localhost only (give it "
                                      "--api-key to serve other names through a proxy)")
        origin = headers.get("origin")
        if origin is None:
            return await self.app(scope, receive, send)
        if not self.origin_allowed(origin):
            return await refuse(send, f"requests from the web page origin {json.dumps(origin)[:80]} are not "
                                      "allowed; start the server with --allowed-origins ORIGIN to allow it")
        cors = [(b"access-control-allow-origin", origin.encode("latin-1")), (b"vary", b"Origin")]
        if scope["method"] == "OPTIONS" and "access-control-request-method" in headers:   # a preflight
            await send({"type": "http.response.start", "status": 204, "headers": cors + [
                (b"access-control-allow-methods", ALLOWED_METHODS.encode()),
                (b"access-control-allow-headers", ALLOWED_HEADERS.encode()),
                (b"access-control-max-age", b"600")]})
            return await send({"type": "http.response.body", "body": b""})

        async def send_with_cors(message):
            if message["type"] == "http.response.start":
                message = {**message, "headers": list(message.get("headers", [])) + cors}
            await send(message)

        return await self.app(scope, receive, send_with_cors)


async def refuse(send, why: str) -> None:
    body = json.dumps({"error": {"message": why, "type": "forbidden", "param": None, "code": "forbidden"}}).encode()
    await send({"type": "http.response.start", "status": 403,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})
