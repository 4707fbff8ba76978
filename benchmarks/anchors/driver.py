"""The anchor benchmarks' load driver: clients that run rounds of requests against one server.

Every client sends one request per round; its round r+1 becomes ready when its round r
answered (or, with `round_barrier`, when every client's round r answered; then with
`flush_between_rounds` the driver first empties the server's device cache with
`/flush_cache`, so round r+1 cannot hit SGLang's own prefix cache). Ready requests are sent in
client order, at most `max_in_flight` at a time, one per Poisson arrival (`request_rate`
per second; `inf` sends as soon as a slot is free). A `Workload` gives each request's prompt
and learns its answer, so a multi-turn conversation can grow from it; a fixed list of prompts
is a workload of one round (`Fixed`), sent in list order.

A failed request (HTTP error, a stream without a token, a refused connection) is recorded with
its error and the run goes on (never retried, as SGLang's own client does); a failed flush
raises, because the rounds after it would measure something else.
"""

from __future__ import annotations

import math
import random
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Protocol

from benchmarks.anchors.client import flush_cache, generate

__all__ = ["Workload", "Fixed", "DriverOptions", "Record", "Flush", "DriverRun", "run_rounds"]


class Workload(Protocol):
    """The requests a driver sends: `clients` clients, each one request per round."""

    @property
    def clients(self) -> int: ...

    def prompt(self, client: int, round_: int) -> list[int]:
        """The token ids of `client`'s request in round `round_` (asked once, when it is sent;
        the client's previous round has answered by then)."""
        ...

    def answered(self, client: int, round_: int, output_ids: list[int]) -> None:
        """The request's output (empty if it failed)."""
        ...


@dataclass
class Fixed:
    """A workload of one round: client i sends `prompts[i]`."""

    prompts: list[list[int]]

    @property
    def clients(self) -> int:
        return len(self.prompts)

    def prompt(self, client: int, round_: int) -> list[int]:
        return self.prompts[client]

    def answered(self, client: int, round_: int, output_ids: list[int]) -> None:
        pass


@dataclass(frozen=True)
class DriverOptions:
    """How requests are sent; `ValueError` names a bad value."""

    output_len: int = 16
    max_in_flight: int = 2
    request_rate: float = math.inf
    round_barrier: bool = False
    flush_between_rounds: bool = False
    seed: int = 0
    flush_timeout_s: float = 60.0

    def __post_init__(self) -> None:
        if self.output_len < 1 or self.max_in_flight < 1:
            raise ValueError("output_len and max_in_flight must be >= 1")
        if not self.request_rate > 0:
            raise ValueError(f"request_rate must be > 0 (inf: no pacing), got {self.request_rate}")
        if self.flush_between_rounds and not self.round_barrier:
            # A flush only happens on an idle server; without the barrier there is none.
            raise ValueError("flush_between_rounds needs round_barrier")


@dataclass
class Record:
    """One request as the driver saw it; times in seconds since the run began."""

    client: int
    round: int
    start_s: float
    ttft_s: float
    end_s: float
    prompt_tokens: int
    cached_tokens: int
    output_ids: list[int] = field(default_factory=list)
    error: str = ""


@dataclass(frozen=True)
class Flush:
    """A `/flush_cache` between rounds `after_round` and `after_round + 1`."""

    after_round: int
    start_s: float
    seconds: float


@dataclass
class DriverRun:
    """What one `run_rounds` call measured (records in the order requests were sent)."""

    records: list[Record]
    flushes: list[Flush]
    duration_s: float


class _Dispatch:
    """The state one run shares between its dispatcher and its request threads."""

    def __init__(self, url: str, work: Workload, opts: DriverOptions, rounds: range):
        self.url, self.work, self.opts, self.rounds = url, work, opts, rounds
        self.cond = threading.Condition()
        self.ready: deque[tuple[int, int]] = deque((c, rounds.start)
                                                   for c in range(work.clients))
        self.in_flight = 0
        self.left = dict.fromkeys(rounds, work.clients)  # unanswered requests per round
        self.release: int | None = None  # the round the barrier lets go next
        self.records: list[Record] = []
        self.flushes: list[Flush] = []
        self.t0 = time.perf_counter()

    def run(self) -> DriverRun:
        rng = random.Random(self.opts.seed)
        threads = []
        for i in range(self.work.clients * len(self.rounds)):
            if i and math.isfinite(self.opts.request_rate):  # the gap since the last send
                time.sleep(rng.expovariate(self.opts.request_rate))
            client, round_ = self._take()
            thread = threading.Thread(target=self._send, args=(client, round_), daemon=True)
            thread.start()
            threads.append(thread)
        for thread in threads:
            thread.join()
        self.records.sort(key=lambda r: r.start_s)
        return DriverRun(self.records, self.flushes, time.perf_counter() - self.t0)

    def _take(self) -> tuple[int, int]:
        """The next ready request once a slot is free; opens barrier rounds on the way."""
        while True:
            with self.cond:
                self.cond.wait_for(lambda: self.release is not None
                                   or (bool(self.ready)
                                       and self.in_flight < self.opts.max_in_flight))
                if self.release is None:
                    self.in_flight += 1
                    return self.ready.popleft()
                nxt, self.release = self.release, None
            self._open(nxt)

    def _open(self, round_: int) -> None:
        """Round `round_` after the barrier: flush first (no request is in flight now)."""
        if self.opts.flush_between_rounds:
            start = time.perf_counter() - self.t0
            seconds = flush_cache(self.url, self.opts.flush_timeout_s)
            self.flushes.append(Flush(round_ - 1, start, seconds))
        with self.cond:
            self.ready.extend((c, round_) for c in range(self.work.clients))

    def _send(self, client: int, round_: int) -> None:
        prompt = self.work.prompt(client, round_)
        start = time.perf_counter()
        try:
            reply = generate(self.url, prompt, self.opts.output_len)
            rec = Record(client, round_, reply.sent - self.t0, reply.ttft_s,
                         reply.done - self.t0, reply.prompt_tokens, reply.cached_tokens,
                         reply.output_ids)
        except Exception as exc:  # this request failed; the run and the other clients go on
            now = time.perf_counter() - self.t0
            rec = Record(client, round_, start - self.t0, math.nan, now, len(prompt), 0,
                         error=f"{type(exc).__name__}: {exc}"[:300])
        self.work.answered(client, round_, rec.output_ids)
        with self.cond:
            self.records.append(rec)
            self.in_flight -= 1
            self.left[round_] -= 1
            if round_ + 1 in self.rounds:
                if not self.opts.round_barrier:
                    self.ready.append((client, round_ + 1))
                elif self.left[round_] == 0:
                    self.release = round_ + 1
            self.cond.notify_all()


def run_rounds(url: str, work: Workload, opts: DriverOptions, rounds: range) -> DriverRun:
    """Run rounds `rounds` (e.g. `range(1, 5)`) of `work` against the server at `url`.

    Returns when every request answered or failed. Raises `RequestError` if a flush between
    rounds failed (none is in flight then: the barrier waited for them).
    """
    if len(rounds) < 1 or rounds.step != 1:
        raise ValueError(f"rounds must be a non-empty range with step 1, got {rounds}")
    return _Dispatch(url, work, opts, rounds).run()
