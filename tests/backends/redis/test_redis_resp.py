"""RESP2 reply parsing (`kvtier.backends.redis.resp`) over a real socket pair, fed in pieces."""

from __future__ import annotations

import socket
import threading
from collections.abc import Callable, Iterator

import pytest
from redis.exceptions import ConnectionError as RedisConnectionError

from kvtier.backends.redis.resp import ReplyError, ReplyReader

REPLIES = (b":1\r\n+OK\r\n-ERR no such key\r\n$3\r\nabc\r\n:0\r\n*2\r\n:1\r\n$-1\r\n:12\r\n"
           b"+QUEUED\r\n")


Feed = Callable[[bytes, int], ReplyReader]


@pytest.fixture
def feed() -> Iterator[Feed]:
    """`feed(data, step)`: a reader on one end of a socket pair; the other end sends `data`
    `step` bytes at a time (replies and lines cut anywhere) and closes."""
    ours: list[socket.socket] = []

    def start(data: bytes, step: int) -> ReplyReader:
        mine, theirs = socket.socketpair()
        ours.append(mine)

        def send() -> None:
            with theirs:
                try:
                    for i in range(0, len(data), step):
                        theirs.sendall(data[i:i + step])
                except OSError:  # the reader stopped early (a protocol error) and closed
                    pass

        threading.Thread(target=send, daemon=True).start()
        mine.settimeout(10)
        return ReplyReader(mine)

    yield start
    for sock in ours:
        sock.close()


@pytest.mark.parametrize("step", [1, 3, 7, len(REPLIES)])
def test_replies_match_reply_one_at_a_time(feed: Feed, step: int) -> None:
    batched = feed(REPLIES, step).replies(7)
    reader = feed(REPLIES, step)
    single = [reader.reply() for _ in range(7)]
    for got in (batched, single):
        assert got[:2] == [1, b"OK"]
        assert isinstance(got[2], ReplyError) and "no such key" in str(got[2])
        assert got[3:] == [b"abc", 0, [1, None], 12]


def test_replies_leave_later_replies_unread(feed: Feed) -> None:
    reader = feed(REPLIES + b":7\r\n", len(REPLIES) + 4)
    assert reader.replies(7)[-1] == 12
    assert reader.replies(1) == [b"QUEUED"]
    assert reader.reply() == 7
    assert reader.pending == 0


def test_many_integer_replies_at_once(feed: Feed) -> None:
    data = b"".join(b":%d\r\n" % (i % 2) for i in range(5000))  # past one read buffer
    assert feed(data, 4096).replies(5000) == [i % 2 for i in range(5000)]


def test_a_bad_reply_is_a_protocol_error(feed: Feed) -> None:
    with pytest.raises(RedisConnectionError, match="bad number"):
        feed(b":1\r\n:x\r\n", 100).replies(2)
    with pytest.raises(RedisConnectionError, match="closed"):
        feed(b":1\r\n", 100).replies(2)
