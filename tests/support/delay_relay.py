"""A TCP relay that delays every chunk, each way, by DELAY ± JITTER ms (random per chunk) and keeps byte order:
latency with jitter in userspace, for kernels without sch_netem. Stdlib only (runs as `python3` inside a host's
network namespace: `ip netns exec mla-hNN python3 delay_relay.py --listen ADDR:PORT --to ADDR:22`).

A chunk's release time is its arrival plus its own random delay, but never before the previous chunk's release
(TCP's order must hold), so jitter is a varying per-chunk delay with order kept. With --split each chunk also
leaves as 1-4 pieces of random size, each with its own delay. Prints `listening ADDR:PORT` once it accepts, and on
SIGTERM/SIGINT one JSON line of what it did (connections, chunks delayed, total added delay), then exits."""
from __future__ import annotations

import argparse
import asyncio
import json
import random
import signal
import sys
import time

STATS = {"connections": 0, "chunks": 0, "bytes": 0, "added_delay_s": 0.0, "min_delay_s": None}


def _pieces(data: bytes, split: bool) -> list[bytes]:
    if not split or len(data) < 2:
        return [data]
    cuts = sorted(random.sample(range(1, len(data)), min(len(data) - 1, random.randint(0, 3))))
    return [data[a:b] for a, b in zip([0] + cuts, cuts + [len(data)])]


async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, delay: float, jitter: float,
                split: bool) -> None:
    queue: asyncio.Queue = asyncio.Queue()

    async def read() -> None:
        last = 0.0
        try:
            while True:
                data = await reader.read(65536)
                if not data:
                    break
                for piece in _pieces(data, split):
                    d = max(0.0, random.uniform(delay - jitter, delay + jitter))
                    now = time.monotonic()
                    release = max(now + d, last)  # never before the previous piece: order kept
                    last = release
                    STATS["chunks"] += 1
                    STATS["bytes"] += len(piece)
                    STATS["added_delay_s"] += release - now
                    m = STATS["min_delay_s"]
                    STATS["min_delay_s"] = release - now if m is None else min(m, release - now)
                    queue.put_nowait((release, piece))
        except (ConnectionError, OSError):
            pass
        queue.put_nowait((None, b""))

    task = asyncio.ensure_future(read())
    try:
        while True:
            release, piece = await queue.get()
            if release is None:
                break
            wait = release - time.monotonic()
            if wait > 0:
                await asyncio.sleep(wait)
            writer.write(piece)
            await writer.drain()
        if writer.can_write_eof():
            writer.write_eof()
    except (ConnectionError, OSError):
        task.cancel()
    finally:
        await asyncio.gather(task, return_exceptions=True)


async def _serve(args) -> None:
    thost, tport = args.to.rsplit(":", 1)
    lhost, lport = args.listen.rsplit(":", 1)
    delay, jitter = args.delay_ms / 1000, args.jitter_ms / 1000

    async def handle(cr: asyncio.StreamReader, cw: asyncio.StreamWriter) -> None:
        STATS["connections"] += 1
        try:
            sr, sw = await asyncio.open_connection(thost, int(tport))
        except OSError as e:
            print(f"delay_relay: cannot reach {args.to}: {e}", file=sys.stderr, flush=True)
            cw.close()
            return
        await asyncio.gather(_pipe(cr, sw, delay, jitter, args.split), _pipe(sr, cw, delay, jitter, args.split),
                             return_exceptions=True)
        for w in (cw, sw):
            w.close()

    server = await asyncio.start_server(handle, lhost, int(lport))
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    print(f"listening {args.listen}", flush=True)
    await stop.wait()
    server.close()
    await server.wait_closed()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--listen", required=True, help="ADDR:PORT to accept on")
    ap.add_argument("--to", required=True, help="ADDR:PORT to forward to")
    ap.add_argument("--delay-ms", type=float, default=40.0)
    ap.add_argument("--jitter-ms", type=float, default=20.0)
    ap.add_argument("--split", action="store_true", help="send each chunk as 1-4 pieces of random size")
    args = ap.parse_args(argv)
    asyncio.run(_serve(args))
    print(json.dumps(STATS), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
