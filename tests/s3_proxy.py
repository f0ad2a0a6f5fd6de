"""A small HTTP proxy in front of an S3 API server that injects faults: latency, 503s, resets, stalls, 403s.

Run as a process: ``python tests/s3_proxy.py UPSTREAM_PORT`` prints ``port=N`` once it listens
on 127.0.0.1. Tests and benchmarks steer it while it runs with requests to the proxy itself:

- ``GET /__proxy__/set?latency=0.01&fail503=3&drop=2&stall=1&deny=1`` sets the added latency
  (seconds per request) and how many of the next requests answer 503 SlowDown, are dropped
  (connection closed without an answer), stall (never answered) or answer 403 InvalidAccessKeyId;
  ``stall_put_body=k`` stalls the next k PUT requests before their body (headers read, the body
  never read, no ``100 Continue``, never answered);
  ``deny=-1`` denies every request; ``every503=k`` answers 503 SlowDown to every k-th data request
  (0: never), so that every kind of request a run makes meets a fault; ``max_inflight=k`` answers
  503 SlowDown to a data request that arrives while k others are in flight (a store that throttles
  above a concurrency it can serve; 0: no limit); ``serial=1`` serves one data request at a time
  (a one-thread server: the others queue, their time counts against the client's timeouts);
- ``GET /__proxy__/stats`` answers JSON ``{"requests": n, "ranged": n, "pinned": n, "bytes": n, "503s": n,
  "agents": {...}}`` (data requests so far, those with a Range header, those of them with an
  If-Match header, body bytes returned, 503s answered, and the
  ranged ones by client: the User-Agent's first product name, e.g. ``object_store``, ``aiobotocore``);
- ``GET /__proxy__/reset`` zeroes the counters and the faults.

Requests are forwarded byte for byte (the Host header is kept, so signatures still match),
one upstream connection per request; the client's connection is kept alive.
"""

from __future__ import annotations

import asyncio
import json
import sys
from urllib.parse import parse_qs, urlsplit

STATE = {
    "latency": 0.0, "fail503": 0, "drop": 0, "stall": 0, "stall_put_body": 0, "deny": 0, "every503": 0,
    "max_inflight": 0, "serial": 0,
}  # fmt: skip
INFLIGHT = [0]
_SERIAL: list[asyncio.Lock] = []
STATS: dict = {"requests": 0, "ranged": 0, "pinned": 0, "bytes": 0, "503s": 0, "most_inflight": 0, "agents": {}}

_SLOWDOWN = (
    b'<?xml version="1.0" encoding="UTF-8"?><Error><Code>SlowDown</Code>'
    b"<Message>Please reduce your request rate.</Message></Error>"
)
_DENIED = (
    b'<?xml version="1.0" encoding="UTF-8"?><Error><Code>InvalidAccessKeyId</Code>'
    b"<Message>The AWS Access Key Id you provided does not exist in our records.</Message></Error>"
)


def _response(status: str, body: bytes, head_only: bool = False) -> bytes:
    head = f"HTTP/1.1 {status}\r\nContent-Type: application/xml\r\nContent-Length: {len(body)}\r\n"
    head += "Connection: keep-alive\r\n\r\n"
    return head.encode() + (b"" if head_only else body)  # a HEAD answer has no body


async def _read_message(
    reader: asyncio.StreamReader, writer: asyncio.StreamWriter
) -> tuple[bytes, dict[str, str], bytes] | None:
    try:
        head = await reader.readuntil(b"\r\n\r\n")
    except (asyncio.IncompleteReadError, ConnectionError):
        return None
    if head.startswith(b"PUT ") and _take("stall_put_body"):
        await asyncio.sleep(3600)
        return None
    lines = head.decode("latin-1").split("\r\n")
    headers = {}
    for line in lines[1:]:
        if ":" in line:
            k, v = line.split(":", 1)
            headers[k.strip().lower()] = v.strip()
    body = b""
    if headers.get("expect", "").lower() == "100-continue":  # the client sends its body only when asked
        writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")
        await writer.drain()
        head = "\r\n".join(line for line in lines if not line.lower().startswith("expect:")).encode("latin-1")
    if "content-length" in headers:
        body = await reader.readexactly(int(headers["content-length"]))
    return head, headers, body


def _control(target: str) -> bytes:
    url = urlsplit(target)
    if url.path == "/__proxy__/set":
        for key, values in parse_qs(url.query).items():
            STATE[key] = float(values[0]) if key == "latency" else int(values[0])
    elif url.path == "/__proxy__/reset":
        STATE.update({key: 0 for key in STATE}, latency=0.0)
        STATS.update(requests=0, ranged=0, pinned=0, bytes=0, most_inflight=0, agents={}, **{"503s": 0})
    return _response("200 OK", json.dumps({**STATE, **STATS}).encode())


def _take(key: str) -> bool:
    if STATE[key] == -1:
        return True
    if STATE[key] > 0:
        STATE[key] -= 1
        return True
    return False


async def _forward(upstream_port: int, head: bytes, body: bytes) -> tuple[bytes, bool]:
    """The upstream's whole answer, and whether the client connection may stay open."""
    lines = head.decode("latin-1").split("\r\n")
    kept = [line for line in lines if line and not line.lower().startswith(("connection:", "keep-alive:"))]
    request = ("\r\n".join(kept) + "\r\nConnection: close\r\n\r\n").encode("latin-1") + body
    reader, writer = await asyncio.open_connection("127.0.0.1", upstream_port)
    try:
        writer.write(request)
        await writer.drain()
        answer = await reader.read()  # Connection: close, so the answer ends at EOF
    finally:
        writer.close()
    split = answer.find(b"\r\n\r\n")
    if split < 0:
        return answer, False
    header_lines = answer[:split].decode("latin-1").split("\r\n")
    chunked = any(h.lower().startswith("transfer-encoding:") for h in header_lines)
    kept = [h for h in header_lines if not h.lower().startswith(("connection:", "keep-alive:"))]
    kept.append("Connection: close" if chunked else "Connection: keep-alive")
    payload = answer[split + 4 :]
    STATS["bytes"] += len(payload)
    return ("\r\n".join(kept) + "\r\n\r\n").encode("latin-1") + payload, not chunked


async def _answer(upstream_port: int, writer: asyncio.StreamWriter, head: bytes, body: bytes, inflight: int) -> bool:
    """Answer one data request (a fault, or the upstream's answer); False when the connection must close."""
    if STATE["latency"]:
        await asyncio.sleep(STATE["latency"])
    if _take("stall"):
        await asyncio.sleep(3600)
        return False
    if _take("drop"):
        return False
    is_head = head.startswith(b"HEAD ")
    every = STATE["every503"] and STATS["requests"] % STATE["every503"] == 0
    crowded = STATE["max_inflight"] and inflight > STATE["max_inflight"]
    if _take("deny"):
        writer.write(_response("403 Forbidden", _DENIED, is_head))
    elif _take("fail503") or every or crowded:
        STATS["503s"] += 1
        writer.write(_response("503 Slow Down", _SLOWDOWN, is_head))
    else:
        answer, keep = await _forward(upstream_port, head, body)
        writer.write(answer)
        if not keep:
            await writer.drain()
            return False
    await writer.drain()
    return True


async def _serve(upstream_port: int, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        while True:
            message = await _read_message(reader, writer)
            if message is None:
                return
            head, headers, body = message
            target = head.split(b" ", 2)[1].decode("latin-1")
            if target.startswith("/__proxy__/"):
                writer.write(_control(target))
                await writer.drain()
                continue
            STATS["requests"] += 1
            STATS["ranged"] += "range" in headers
            if "range" in headers:
                STATS["pinned"] += "if-match" in headers
                agent = headers.get("user-agent", "").split("/", 1)[0] or "?"
                STATS["agents"][agent] = STATS["agents"].get(agent, 0) + 1
            INFLIGHT[0] += 1
            STATS["most_inflight"] = max(STATS["most_inflight"], INFLIGHT[0])
            try:
                if STATE["serial"]:
                    if not _SERIAL:
                        _SERIAL.append(asyncio.Lock())
                    async with _SERIAL[0]:
                        keep = await _answer(upstream_port, writer, head, body, INFLIGHT[0])
                else:
                    keep = await _answer(upstream_port, writer, head, body, INFLIGHT[0])
            finally:
                INFLIGHT[0] -= 1
            if not keep:
                return
    except (ConnectionError, asyncio.IncompleteReadError):
        return
    finally:
        writer.close()


async def main(upstream_port: int, port: int = 0) -> None:
    server = await asyncio.start_server(lambda r, w: _serve(upstream_port, r, w), "127.0.0.1", port)
    print(f"port={server.sockets[0].getsockname()[1]}", flush=True)
    async with server:
        await server.serve_forever()


if __name__ == "__main__":
    asyncio.run(main(int(sys.argv[1]), int(sys.argv[2]) if len(sys.argv) > 2 else 0))
