"""The anchor benchmarks' HTTP client: the two calls of SGLang's API they use.

`generate` sends one greedy `/generate` request with token ids and `stream: true`, and times
it as a client sees it (first streamed output token = TTFT); `flush_cache` posts
`/flush_cache?timeout=S`, which SGLang answers once its scheduler is idle (or with HTTP 400
after S seconds). Stdlib only, so the tests can drive a stdlib server with it and the module
imports where SGLang is not installed.
"""

from __future__ import annotations

import http.client
import json
import time
import urllib.parse
from dataclasses import dataclass, field
from typing import Any

__all__ = ["Reply", "RequestError", "generate", "flush_cache", "split_url"]

REQUEST_TIMEOUT_S = 600.0


class RequestError(RuntimeError):
    """A request the server refused or answered without an output token."""


@dataclass(frozen=True)
class Reply:
    """One streamed generation. Times are `time.perf_counter()` readings of this process."""

    sent: float
    first_token: float
    done: float
    output_ids: list[int] = field(default_factory=list)
    prompt_tokens: int = 0
    cached_tokens: int = 0

    @property
    def ttft_s(self) -> float:
        return self.first_token - self.sent


def split_url(url: str) -> tuple[str, int]:
    """(host, port) of an `http://host:port` URL; `ValueError` naming the URL otherwise."""
    parts = urllib.parse.urlsplit(url)
    if parts.scheme != "http" or not parts.hostname or parts.port is None:
        raise ValueError(f"expected http://host:port, got {url!r}")
    return parts.hostname, parts.port


def _body(input_ids: list[int], max_new_tokens: int) -> bytes:
    return json.dumps({
        "input_ids": input_ids, "stream": True,
        "sampling_params": {"temperature": 0.0, "max_new_tokens": max_new_tokens,
                            "ignore_eos": True},
    }).encode()


def generate(url: str, input_ids: list[int], max_new_tokens: int,
             timeout: float = REQUEST_TIMEOUT_S) -> Reply:
    """Greedy generation of exactly `max_new_tokens` tokens (EOS ignored) from `input_ids`.

    Streamed chunks carry the output so far (SGLang without `--incremental-streaming-output`),
    so the last chunk's `output_ids` is the answer and its `meta_info` holds `prompt_tokens`
    and `cached_tokens`. Raises `RequestError` on an HTTP error or a stream without a token,
    `OSError` when the server cannot be reached.
    """
    host, port = split_url(url)
    conn = http.client.HTTPConnection(host, port, timeout=timeout)
    try:
        sent = time.perf_counter()
        conn.request("POST", "/generate", _body(input_ids, max_new_tokens),
                     {"Content-Type": "application/json"})
        resp = conn.getresponse()
        if resp.status != 200:
            raise RequestError(f"/generate: HTTP {resp.status}: {resp.read()[:300]!r}")
        first, last = _read_stream(resp)
        done = time.perf_counter()
    finally:
        conn.close()
    if first is None:
        raise RequestError(f"/generate streamed no output token: {str(last)[:300]}")
    meta = last.get("meta_info") or {}
    return Reply(sent, first, done, [int(i) for i in last.get("output_ids") or []],
                 int(meta.get("prompt_tokens", len(input_ids))),
                 int(meta.get("cached_tokens", 0)))


def _read_stream(resp: http.client.HTTPResponse) -> tuple[float | None, dict[str, Any]]:
    """(time of the first chunk with an output token, the last chunk with one)."""
    first: float | None = None
    last: dict[str, Any] = {}
    for raw in resp:
        line = raw.strip()
        if not line.startswith(b"data:") or line == b"data: [DONE]":
            continue
        chunk = json.loads(line[5:])
        if "error" in chunk:  # SGLang reports a failed request inside a 200 stream
            raise RequestError(f"/generate: {str(chunk['error'])[:300]}")
        if chunk.get("output_ids"):
            if first is None:
                first = time.perf_counter()
            last = chunk
    return first, last


def flush_cache(url: str, timeout_s: float = 30.0) -> float:
    """Empty the server's device prefix cache once it is idle; returns the seconds it took.

    SGLang waits up to `timeout_s` for running requests to finish (its `timeout` query
    parameter) and answers 400 if they did not; that raises `RequestError`: a flush that did
    not happen would make the next round's numbers wrong.
    """
    host, port = split_url(url)
    conn = http.client.HTTPConnection(host, port, timeout=timeout_s + 60)
    try:
        start = time.perf_counter()
        conn.request("POST", f"/flush_cache?timeout={timeout_s:g}", b"",
                     {"Content-Type": "application/json"})
        resp = conn.getresponse()
        text = resp.read()[:300]
        if resp.status != 200:
            raise RequestError(f"/flush_cache: HTTP {resp.status}: {text!r}")
        return time.perf_counter() - start
    finally:
        conn.close()
