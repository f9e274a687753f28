"""A load benchmark for a running server: N clients, each sending System One requests one after
another (3 questions about a support ticket), for a fixed count of requests. Reports errors,
p50 and p95 latency and requests per second; no third-party client, only the standard library.

    python -m prefixcache.serve.loadtest http://127.0.0.1:8000 --clients 1 8 --requests 48

With `--heavy K`, K more clients send heavy requests (one 255-option choice question each) for as
long as the light ones run: the light requests' p50/p95 then say how long a light request waits
behind heavy ones. The server's memory (its `/health` `rss_mb`) is printed before and after.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import threading
import time
import urllib.error
import urllib.request
from dataclasses import asdict, dataclass
from typing import Any, Sequence

TICKETS = [
    "I was charged twice for my March invoice and the refund you promised last week has not arrived. Please fix "
    "this today or I will dispute the charge with my bank.",
    "Since the update this morning the app crashes every time I open the reports page. My whole team is blocked "
    "and we have a client demo at three.",
    "Could you send me a quote for 40 more seats? We are growing and would like to know about volume discounts "
    "before our budget meeting on Friday.",
    "I cannot log in: the password reset e-mail never arrives, I checked the spam folder twice. I need access to "
    "download last year's statements.",
    "Your export to CSV drops every row with an accent in the customer's name. It has happened for a month and I "
    "have reported it before. Not impressed.",
    "Hello, just checking whether the outage mentioned on your status page affects the European region, we have "
    "not noticed anything yet.",
]
QUESTIONS = {
    "refund": {"type": "noul", "instructions": "Does the customer ask for money back?"},
    "team": {"type": "choice", "instructions": "Which team should handle the ticket?",
             "criteria": {"Billing": "invoices, charges, refunds", "Technical": "bugs, outages, log-in problems",
                          "Sales": "quotes, seats, upgrades"}},
    "anger": {"type": "score", "instructions": "How upset is the customer?", "criteria": ["calm", "annoyed", "furious"]},
}


@dataclass
class Load:
    """One load level's figures."""

    clients: int
    requests: int
    errors: int
    p50_ms: float
    p95_ms: float
    requests_per_s: float


def _percentile(values: Sequence[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))]


HEAVY = {"country": {"type": "choice", "instructions": "Which queue should handle the ticket?", "list": False,
                     "criteria": {f"Queue {i:03d}": f"Tickets routed to queue {i}" for i in range(255)}}}


def _heavy(url: str, stop: threading.Event, sent: list[int], timeout: float) -> None:
    """Send heavy requests, one after another, until `stop`; count them in `sent`."""
    n = 0
    while not stop.is_set():
        body = json.dumps({"model": "local", "state": TICKETS[n % len(TICKETS)] + f" (heavy {time.time_ns()})",
                           "questions": HEAVY}).encode()
        request = urllib.request.Request(url.rstrip("/") + "/v1/systemone", data=body,
                                         headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=timeout) as resp:
                resp.read()
        except (urllib.error.URLError, OSError):
            pass
        sent[0] += 1
        n += 1


def rss_mb(url: str) -> float | None:
    """The server's resident memory in MB, as its /health says."""
    try:
        with urllib.request.urlopen(url.rstrip("/") + "/health", timeout=10) as resp:
            return json.loads(resp.read()).get("rss_mb")
    except (urllib.error.URLError, OSError, ValueError):
        return None


def run_load(url: str, clients: int, requests: int, questions: dict[str, Any] | None = None,
             timeout: float = 120.0, heavy: int = 0) -> Load:
    """Send `requests` requests from `clients` threads (each sends its share one after another),
    while `heavy` more threads send heavy requests."""
    endpoint = url.rstrip("/") + "/v1/systemone"
    pack = questions or QUESTIONS
    latencies: list[float] = []
    errors = [0]
    lock = threading.Lock()
    run = f"{clients}.{time.time_ns() % 10**9}"  # every body its own: the server computes identical requests once

    def client(k: int) -> None:
        for n in range(k, requests, clients):
            body = json.dumps({"model": "local", "state": TICKETS[n % len(TICKETS)] + f" (ref {run}.{n})",
                               "questions": pack}).encode()
            request = urllib.request.Request(endpoint, data=body, headers={"Content-Type": "application/json"})
            start = time.perf_counter()
            try:
                with urllib.request.urlopen(request, timeout=timeout) as resp:
                    ok = resp.status == 200 and "answers" in json.loads(resp.read())
            except (urllib.error.URLError, OSError, ValueError):
                ok = False
            with lock:
                latencies.append((time.perf_counter() - start) * 1000)
                errors[0] += not ok

    stop, sent = threading.Event(), [0]
    heavies = [threading.Thread(target=_heavy, args=(url, stop, sent, timeout)) for _ in range(heavy)]
    for t in heavies:
        t.start()
    if heavy:
        time.sleep(1.0)  # the heavy requests are queued or in a pass before the light ones come
    threads = [threading.Thread(target=client, args=(k,)) for k in range(clients)]
    start = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - start
    stop.set()
    for t in heavies:
        t.join()
    return Load(clients, requests, errors[0], statistics.median(latencies), _percentile(latencies, 0.95), requests / wall)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m prefixcache.serve.loadtest", description=__doc__.split("\n\n")[0])
    parser.add_argument("url", help="the server, e.g. http://127.0.0.1:8000")
    parser.add_argument("--clients", type=int, nargs="+", default=[1, 8], help="client counts to run, one after another")
    parser.add_argument("--requests", type=int, default=48, help="requests per client count")
    parser.add_argument("--warm-up", type=int, default=2, help="requests sent first and not counted")
    parser.add_argument("--heavy", type=int, default=0, help="clients sending heavy requests meanwhile")
    parser.add_argument("--json", action="store_true", help="print the figures as JSON")
    args = parser.parse_args(argv)
    before = rss_mb(args.url)
    run_load(args.url, 1, args.warm_up)
    loads = [run_load(args.url, c, args.requests, heavy=args.heavy) for c in args.clients]
    print(f"server memory: {before} MB before, {rss_mb(args.url)} MB after", file=sys.stderr)
    if args.json:
        print(json.dumps([asdict(x) for x in loads], indent=2))
    else:
        print(f"{'clients':>7} {'requests':>8} {'errors':>6} {'p50 ms':>8} {'p95 ms':>8} {'req/s':>7}")
        for x in loads:
            print(f"{x.clients:>7} {x.requests:>8} {x.errors:>6} {x.p50_ms:>8.1f} {x.p95_ms:>8.1f} {x.requests_per_s:>7.2f}")
        if len(loads) > 1:
            print(f"throughput, {loads[-1].clients} clients over {loads[0].clients}: "
                  f"{loads[-1].requests_per_s / loads[0].requests_per_s:.2f}x")
    return 1 if any(x.errors for x in loads) else 0


if __name__ == "__main__":
    sys.exit(main())
