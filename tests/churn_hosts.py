"""The churn run on simulated hosts (tests/test_membership.py starts it inside host 0): the trainer here, with
the store; actors started, closed, SIGKILLed, SIGSTOPped and continued inside hosts 1..n-1 at random (sync mode:
through a relay chain across the hosts, healed around each that fails). Prints one JSON line: the events, the
actors' stats, the sender's receivers, the transports seen, push errors."""

from __future__ import annotations

import json
import sys

import churn
import cudarecv


def main(
    namespaces: list[str], address: str, events: int, seed: int, timeout: float, mode: str
) -> None:
    with churn.master_store(address) as store:
        td = churn.weights(1)
        sender = cudarecv.ElasticSender(td, store=store, name="hosts", mode=mode, timeout=timeout)
        sender.push()
        pusher = churn.Pusher(sender, td)
        fleets = [
            churn.Fleet(
                store,
                store.port,
                "hosts",
                timeout,
                seed + i,
                host=address,
                fork=churn.in_host(ns),
                first=1000 * (i + 1),
            )
            for i, ns in enumerate(namespaces)
        ]  # (indices apart)
        transports = set()
        try:
            for k in range(events):
                fleets[k % len(fleets)].event(most=2)
                transports |= {r["transport"] for r in sender.receivers if r["state"] == "served"}
            for fleet in fleets:
                fleet.end()
        finally:
            pusher.stop()
            receivers = sender.receivers
            sender.close()
            for fleet in fleets:
                fleet.end()
        stats = {i: s for fleet in fleets for i, s in fleet.stats().items()}
        out = {
            "events": [fleet.events for fleet in fleets],
            "stats": stats,
            "errors": [repr(e) for e in pusher.errors],
            "receivers": receivers,
            "ended": [(i, how) for fleet in fleets for i, _, how in fleet.ended],
            "transports": sorted(transports),
        }
    print("CHURN " + json.dumps(out), flush=True)


if __name__ == "__main__":
    main(
        sys.argv[1].split(","),
        sys.argv[2],
        int(sys.argv[3]),
        int(sys.argv[4]),
        float(sys.argv[5]),
        sys.argv[6],
    )
