"""Who may use the server, and from which page: API keys, the Host header, CORS, JSON bodies.

- API keys (`--api-key`, repeatable, or NANOINFER_API_KEY, comma-separated): every route but
  the open ones (/health and the chat page) needs `Authorization: Bearer KEY` (or `x-api-key:
  KEY`, as Anthropic's clients send it); else 401, `code: "invalid_api_key"`. Routes added
  later are covered by default.
- The Host header: a server bound to a loopback address answers only requests addressed to a
  loopback name (localhost, 127.0.0.1, [::1]) and `--allowed-hosts`. A web page on another
  site could otherwise reach it by pointing its own domain name at 127.0.0.1 (DNS rebinding).
- CORS (`--allowed-origins`, default none): a browser may call the API from the pages of those
  origins only; their preflights are answered, other origins' are refused, and so are their
  requests (a page's own origin is always allowed).
- POST bodies must be `application/json` (else 415): a cross-site form or `text/plain` fetch
  needs no preflight, so without this check any web page could make the server generate.

The single server applies it as ASGI middleware around its app; `--replicas` applies it in the
router, before a request reaches any replica.
"""
from __future__ import annotations

import hmac
import json
import os
from collections.abc import Mapping
from dataclasses import dataclass

OPEN_PATHS = frozenset({"/health", "/", "/favicon.ico"})
LOOPBACK_NAMES = ("localhost", "127.0.0.1", "::1", "[::1]")
_LOOPBACK_BINDS = {"localhost", "127.0.0.1", "::1", "[::1]"}
_METHODS = "GET, POST, OPTIONS"
_ALLOWED_HEADERS = "authorization, content-type, x-api-key, anthropic-version, openai-organization, openai-project"


@dataclass(frozen=True)
class Refusal:
    status: int
    body: dict
    headers: dict[str, str]

    def encoded(self) -> bytes:
        return json.dumps(self.body).encode()


@dataclass(frozen=True)
class AccessPolicy:
    api_keys: tuple[str, ...] = ()
    allowed_origins: tuple[str, ...] = ()  # "*": any
    allowed_hosts: tuple[str, ...] | None = None  # None: any Host header

    @classmethod
    def of(cls, bind_host: str, api_keys: list[str] | None = None, allowed_origins: list[str] | None = None,
           allowed_hosts: list[str] | None = None) -> AccessPolicy:
        """The policy for a server bound to `bind_host`; keys from NANOINFER_API_KEY too."""
        keys = [*(api_keys or []), *(k for k in os.environ.get("NANOINFER_API_KEY", "").split(",") if k.strip())]
        hosts = None
        if bind_host in _LOOPBACK_BINDS or bind_host.startswith("127."):
            hosts = (*LOOPBACK_NAMES, *(allowed_hosts or []))
        elif allowed_hosts:
            hosts = tuple(allowed_hosts)
        return cls(tuple(k.strip() for k in keys), tuple(o.rstrip("/") for o in allowed_origins or []),
                   None if hosts is None else tuple(h.lower() for h in hosts))

    def origin_allowed(self, origin: str, host: str) -> bool:
        origin = origin.rstrip("/")
        if origin in (f"http://{host}", f"https://{host}"):  # the page's own origin
            return True
        return "*" in self.allowed_origins or origin in self.allowed_origins

    def check(self, method: str, path: str, headers: Mapping[str, str]) -> Refusal | None:
        """None to go on, or the response that ends the request here. `headers`: lower-case names."""
        host = headers.get("host", "")
        if self.allowed_hosts is not None and _host_name(host) not in self.allowed_hosts:
            return _refuse(403, f"Host {host!r} is not served here (a loopback-bound server answers loopback "
                                f"names and --allowed-hosts)", "host_not_allowed")
        origin = headers.get("origin")
        if origin is not None and not self.origin_allowed(origin, host):
            return _refuse(403, f"origin {origin!r} is not allowed (--allowed-origins)", "origin_not_allowed")
        if method == "OPTIONS" and origin is not None and "access-control-request-method" in headers:
            return Refusal(204, {}, {**self.cors_headers(origin), "Access-Control-Allow-Methods": _METHODS,
                                     "Access-Control-Allow-Headers": _ALLOWED_HEADERS,
                                     "Access-Control-Max-Age": "600"})
        if path not in OPEN_PATHS:
            if self.api_keys and not self._key_ok(headers):
                refusal = _refuse(401, "a valid API key is needed: send 'Authorization: Bearer KEY'", "invalid_api_key")
                refusal.headers["WWW-Authenticate"] = "Bearer"
                return refusal
            if method in ("POST", "PUT", "PATCH"):
                media = headers.get("content-type", "").split(";")[0].strip().lower()
                if media != "application/json":
                    return _refuse(415, f"the request body must be application/json, not {media or 'unlabelled'}",
                                   "unsupported_media_type")
        return None

    def cors_headers(self, origin: str | None) -> dict[str, str]:
        """What a response to a cross-origin request carries (the check let it through)."""
        if origin is None:
            return {}
        return {"Access-Control-Allow-Origin": origin.rstrip("/"), "Vary": "Origin",
                "Access-Control-Expose-Headers": "*"}

    def _key_ok(self, headers: Mapping[str, str]) -> bool:
        given = headers.get("x-api-key", "")
        auth = headers.get("authorization", "")
        if auth[:7].lower() == "bearer ":
            given = auth[7:].strip()
        return any(hmac.compare_digest(given.encode(), k.encode()) for k in self.api_keys)


def _host_name(host: str) -> str:
    host = host.strip().lower()
    if host.startswith("["):  # [::1]:8000
        return host[:host.find("]") + 1]
    return host.rsplit(":", 1)[0] if host.count(":") == 1 else host


def _refuse(status: int, message: str, code: str) -> Refusal:
    return Refusal(status, {"error": {"message": message, "type": "invalid_request_error", "param": None,
                                      "code": code}}, {"Content-Type": "application/json"})


class AccessMiddleware:
    """The policy around an ASGI app."""

    def __init__(self, app, policy: AccessPolicy):
        self.app, self.policy = app, policy

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        refusal = self.policy.check(scope["method"], scope["path"], headers)
        if refusal is not None:
            body = refusal.encoded() if refusal.status != 204 else b""
            await send({"type": "http.response.start", "status": refusal.status,
                        "headers": [(k.lower().encode(), v.encode()) for k, v in refusal.headers.items()]})
            await send({"type": "http.response.body", "body": body})
            return
        extra = [(k.lower().encode(), v.encode()) for k, v in self.policy.cors_headers(headers.get("origin")).items()]
        if not extra:
            return await self.app(scope, receive, send)

        async def send_with_cors(message) -> None:
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", []), *extra]}
            await send(message)

        await self.app(scope, receive, send_with_cors)
