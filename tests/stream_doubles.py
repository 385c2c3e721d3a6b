"""Test doubles for the `openai` engine's streamed requests: an HTTP proxy in front of a real
`speccheck serve` that forwards every request unchanged, except that streamed
``/v1/completions`` requests get the answer of one named misbehaviour (a server that does not
stream, one that buffers, drops the connection, sends garbage, refuses the key, ...). Only
the proxy is a double; the tokens it relays come from the real server behind it."""
from __future__ import annotations

import contextlib
import json
import socket
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Iterator

import httpx

#: the misbehaviours, each a way a streamed /v1/completions can go wrong (or merely differ)
BEHAVIOURS = (
    "plain_json",      # answers a stream request with the non-streamed JSON (does not stream)
    "one_event",       # streams, but the whole completion in one event (a buffering proxy)
    "drop",            # relays the first event, then cuts the connection mid-body
    "no_done",         # relays every event, then ends cleanly without data: [DONE]
    "garbage",         # a data: line that is not JSON
    "truncated_json",  # the first event's JSON cut in half
    "error_event",     # the first event, then vLLM's in-stream error (GenerationError)
    "nan_event",       # an in-stream error about NaN logprobs
    "second_choice",   # an event for choice index 1 of a one-choice request
    "list_event",      # a JSON event that is not an object
    "empty",           # data: [DONE] and nothing else
    "bad_types",       # token_ids that are not a list of ids
    "status_401", "status_403", "status_400", "status_404", "status_503",
    "html_200",        # 200 with an HTML page (a captive portal, a misrouted proxy)
)


def _events(upstream: str, body: dict) -> list[bytes]:
    """The real server's stream for ``body``: its data payloads, [DONE] included."""
    out = []
    with httpx.stream("POST", upstream + "/v1/completions", json=body, timeout=120) as r:
        for line in r.iter_lines():
            if line.startswith("data: "):
                out.append(line[6:].encode())
    return out


class _Proxy(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: "ProxyServer"

    def log_message(self, *a) -> None:
        pass

    def _plain(self, status: int, body: bytes, ctype: str = "application/json") -> None:
        self.send_response(status)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def _forward(self, method: str, body: bytes | None) -> None:
        headers = {k: v for k, v in self.headers.items()
                   if k.lower() in ("authorization", "content-type")}
        r = httpx.request(method, self.server.upstream + self.path, content=body,
                          headers=headers, timeout=120)
        self._plain(r.status_code, r.content, r.headers.get("content-type", "application/json"))

    def do_GET(self) -> None:
        self._forward("GET", None)

    def do_POST(self) -> None:
        raw = self.rfile.read(int(self.headers.get("Content-Length") or 0))
        body = json.loads(raw or b"{}")
        if self.path != "/v1/completions" or not body.get("stream"):
            return self._forward("POST", raw)
        self.server.streamed += 1
        getattr(self, "_" + self.server.behaviour)(body)

    # --- the answers -------------------------------------------------------------------------

    def _sse(self, payloads: list[bytes], end: bool = True) -> None:
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        for p in payloads:
            event = b"data: " + p + b"\n\n"
            self.wfile.write(b"%X\r\n%s\r\n" % (len(event), event))
            self.wfile.flush()
        if end:
            self.wfile.write(b"0\r\n\r\n")

    def _error(self, status: int, message: str) -> None:
        body = {"error": "Unauthorized"} if status == 401 else \
            {"error": {"message": message, "type": "Error", "param": None, "code": status}}
        self._plain(status, json.dumps(body).encode())

    def _plain_json(self, body: dict) -> None:
        body = {**body, "stream": False}
        r = httpx.post(self.server.upstream + "/v1/completions", json=body, timeout=120)
        self._plain(r.status_code, r.content)

    def _one_event(self, body: dict) -> None:
        r = httpx.post(self.server.upstream + "/v1/completions", json={**body, "stream": False},
                       timeout=120).json()
        self._sse([json.dumps(r).encode(), b"[DONE]"])

    def _drop(self, body: dict) -> None:
        first = _events(self.server.upstream, body)[0]
        self._sse([first], end=False)  # no terminating chunk: the body is incomplete
        self.close_connection = True
        with contextlib.suppress(OSError):
            self.connection.shutdown(socket.SHUT_RDWR)

    def _no_done(self, body: dict) -> None:
        self._sse([e for e in _events(self.server.upstream, body) if e != b"[DONE]"])

    def _garbage(self, body: dict) -> None:
        self._sse([b"<html>upstream timed out</html>", b"[DONE]"])

    def _truncated_json(self, body: dict) -> None:
        first = _events(self.server.upstream, body)[0]
        self._sse([first[: len(first) // 2], b"[DONE]"])

    def _error_event(self, body: dict) -> None:
        first = _events(self.server.upstream, body)[0]
        err = {"error": {"message": "Internal server error", "type": "InternalServerError",
                         "param": None, "code": 500}}
        self._sse([first, json.dumps(err).encode(), b"[DONE]"])

    def _nan_event(self, body: dict) -> None:
        err = {"error": {"message": "Out of range float values are not JSON compliant: nan",
                         "type": "BadRequestError", "param": None, "code": 400}}
        self._sse([json.dumps(err).encode(), b"[DONE]"])

    def _second_choice(self, body: dict) -> None:
        ev = json.loads(_events(self.server.upstream, body)[0])
        ev["choices"][0]["index"] = 1
        self._sse([json.dumps(ev).encode(), b"[DONE]"])

    def _list_event(self, body: dict) -> None:
        self._sse([b"[1, 2, 3]", b"[DONE]"])

    def _empty(self, body: dict) -> None:
        self._sse([b"[DONE]"])

    def _bad_types(self, body: dict) -> None:
        ev = json.loads(_events(self.server.upstream, body)[0])
        ev["choices"][0]["token_ids"] = ["one", "two"]
        self._sse([json.dumps(ev).encode(), b"[DONE]"])

    def _status_401(self, body: dict) -> None:
        self._error(401, "")

    def _status_403(self, body: dict) -> None:
        self._error(403, "Forbidden: this key may not stream")

    def _status_400(self, body: dict) -> None:
        self._error(400, "logprobs must be at most 0 for streamed requests on this gateway")

    def _status_404(self, body: dict) -> None:
        self._error(404, "Not Found")

    def _status_503(self, body: dict) -> None:
        self._error(503, "engine is sleeping")

    def _html_200(self, body: dict) -> None:
        self._plain(200, b"<html><body>Please log in to the network</body></html>", "text/html")


class ProxyServer(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, upstream: str, behaviour: str) -> None:
        assert behaviour in BEHAVIOURS, behaviour
        self.upstream, self.behaviour, self.streamed = upstream, behaviour, 0
        super().__init__(("127.0.0.1", 0), _Proxy)


@contextlib.contextmanager
def misbehaving_proxy(upstream: str, behaviour: str) -> Iterator[ProxyServer]:
    """``with misbehaving_proxy(url, "drop") as proxy:`` -- its URL is
    ``f"http://127.0.0.1:{proxy.server_port}"``; ``proxy.streamed`` counts stream requests."""
    proxy = ProxyServer(upstream, behaviour)
    thread = threading.Thread(target=proxy.serve_forever, kwargs={"poll_interval": 0.05},
                              daemon=True)
    thread.start()
    try:
        yield proxy
    finally:
        proxy.shutdown()
        proxy.server_close()
        thread.join(timeout=5)
