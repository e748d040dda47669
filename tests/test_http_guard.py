"""`nanochat serve`'s guard against web pages (app/http_guard.py): Origin and Host checks, CORS for allowed origins.
On a bare app (what reaches it is counted) and on the real server."""

from __future__ import annotations


import pytest

pytest.importorskip("httpx")
from starlette.applications import Starlette            # noqa: E402
from starlette.middleware import Middleware             # noqa: E402
from starlette.responses import PlainTextResponse       # noqa: E402
from starlette.routing import Route                     # noqa: E402
from starlette.testclient import TestClient             # noqa: E402

from nanochat.app.http_guard import Guard, host_of, is_loopback_name   # noqa: E402


def guarded(**options) -> tuple[TestClient, list]:
    reached = []

    async def answer(request):
        reached.append(request.method)
        return PlainTextResponse("ok")

    app = Starlette(routes=[Route("/v1/x", answer, methods=["GET", "POST"])],
                    middleware=[Middleware(Guard, **options)])
    return TestClient(app, base_url="http://127.0.0.1:8000"), reached


@pytest.mark.parametrize("name, loopback", [("localhost", True), ("LOCALHOST.", True), ("app.localhost", True),
                                            ("127.0.0.1", True), ("127.8.9.10", True), ("::1", True),
                                            ("0.0.0.0", False), ("192.168.1.5", False), ("evil.example", False),
                                            ("localhost.evil.example", False), ("", False), (None, False)])
def test_loopback_names(name, loopback):
    assert is_loopback_name(name) is loopback


def test_host_of_a_header():
    assert [host_of(h) for h in ("127.0.0.1:8000", "[::1]:8000", "localhost", "evil.example:80")] == \
        ["127.0.0.1", "::1", "localhost", "evil.example"]


def test_requests_without_an_origin_pass_and_other_pages_are_refused_before_the_api():
    http, reached = guarded()
    assert http.post("/v1/x").text == "ok" and reached == ["POST"]          # curl, the SDKs
    for origin in ("https://evil.example", "null", "http://localhost.evil.example", "file://"):
        got = http.post("/v1/x", headers={"Origin": origin}, content="{}")
        assert got.status_code == 403 and "--allowed-origins" in got.json()["error"]["message"], origin
        assert "access-control-allow-origin" not in got.headers
    assert reached == ["POST"]   # none of them reached the API


def test_pages_of_this_machine_and_the_allowed_origins_get_cors_headers():
    http, reached = guarded(allowed_origins=("https://app.example/",))
    for origin in ("http://localhost:3000", "http://127.0.0.1:5173", "https://[::1]", "https://APP.example"):
        got = http.post("/v1/x", headers={"Origin": origin})
        assert got.status_code == 200 and got.headers["access-control-allow-origin"] == origin
        preflight = http.options("/v1/x", headers={"Origin": origin, "Access-Control-Request-Method": "POST",
                                                   "Access-Control-Request-Headers": "authorization, content-type"})
        assert preflight.status_code == 204 and preflight.headers["access-control-allow-origin"] == origin
        assert "Authorization" in preflight.headers["access-control-allow-headers"]
    assert reached == ["POST"] * 4   # preflights are answered by the guard
    anyone, _ = guarded(allowed_origins=("*",))
    assert anyone.post("/v1/x", headers={"Origin": "https://evil.example"}).status_code == 200


def test_a_loopback_server_without_a_key_answers_loopback_names_only():
    http, reached = guarded(check_host=True)
    assert http.get("/v1/x", headers={"Host": "localhost:8000"}).status_code == 200
    assert http.get("/v1/x", headers={"Host": "[::1]:8000"}).status_code == 200
    rebound = http.get("/v1/x", headers={"Host": "evil.example:8000"})   # a page whose domain now points here
    assert rebound.status_code == 403 and "not a loopback name" in rebound.json()["error"]["message"]
    assert reached == ["GET", "GET"]
    lenient, _ = guarded(check_host=False)   # with --api-key, or listening beyond loopback
    assert lenient.get("/v1/x", headers={"Host": "evil.example:8000"}).status_code == 200
