"""Ray actors join a trainer's weight sync through a store, and one is killed and replaced while it pushes.

No process group is shared by the trainer and the actors: the trainer hosts a TCPStore and a named
``WeightSender``; each Ray actor builds a ``ElasticReceiver(store=..., name=...)`` when it starts and pulls the
newest version whenever it wants one. ``ray.kill`` of an actor never makes a push raise (the sender drops it and
logs it); its replacement joins and gets the newest version on its first pull.

Run (Ray on the CPU, about 15 s):  python examples/ray_actors.py [--actors 3] [--pushes 30]
(Ray is the ray extra: pip install "cudarecv[ray]")
"""

from __future__ import annotations

import argparse
import datetime
import sys

try:
    import ray
except ModuleNotFoundError as missing:  # the ray extra is not installed: say which, not a traceback
    sys.exit(
        f'examples/ray_actors.py needs Ray, the ray extra ({missing}): pip install "cudarecv[ray]"'
    )
import torch
import torch.distributed as dist
from tensordict import TensorDict

import cudarecv

NAME = "policy"


def policy(version: int) -> TensorDict:
    return TensorDict(
        w=torch.full((256, 256), float(version)), b=torch.full((256,), -float(version))
    )


@ray.remote(num_cpus=0)
class Actor:
    """An RL actor: joins the trainer's weight sync through the store, pulls the newest weights when asked."""

    def __init__(self, host: str, port: int) -> None:
        store = dist.TCPStore(host, port, is_master=False, timeout=datetime.timedelta(seconds=60))
        self.receiver = cudarecv.ElasticReceiver(store=store, name=NAME, timeout=60)

    def pull(self) -> tuple[int, bool]:
        """The newest version, and whether every weight of it is that version's (never a mix)."""
        version = self.receiver.pull()
        with self.receiver.reading() as td:
            return version, bool((td["w"] == version).all() and (td["b"] == -version).all())

    def ident(self) -> int:
        """Its receiver's number among the joins (the sender names it so in ``sender.receivers``)."""
        return self.receiver.id

    def close(self) -> None:
        self.receiver.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--actors", type=int, default=3)
    parser.add_argument("--pushes", type=int, default=30)
    args = parser.parse_args()
    if args.pushes < 2 or args.actors < 1:
        parser.error(
            "--pushes must be 2 or more (an actor is killed halfway) and --actors 1 or more"
        )
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    host = ray.util.get_node_ip_address()  # where the actors reach the trainer's store
    store = dist.TCPStore(
        host, 0, is_master=True, wait_for_workers=False, timeout=datetime.timedelta(seconds=60)
    )
    td = policy(0)
    sender = cudarecv.ElasticSender(td, store=store, name=NAME, mode="latest", timeout=60)
    actors = [Actor.remote(host, store.port) for _ in range(args.actors)]
    pulled: list[tuple[int, bool]] = []
    for step in range(1, args.pushes + 1):
        td["w"].fill_(step)
        td["b"].fill_(-step)
        sender.push()  # returns at once (latest mode); a killed actor never makes it raise
        pulled += ray.get([actor.pull.remote() for actor in actors])
        if (
            step == args.pushes // 2
        ):  # an actor is lost (preempted, crashed), and its replacement joins
            killed = ray.get(actors[0].ident.remote())
            ray.kill(actors[0])
            actors[0] = Actor.remote(host, store.port)
    ray.get([actor.close.remote() for actor in actors])
    receivers = sender.receivers
    sender.close()
    ray.shutdown()
    whole = all(ok for _, ok in pulled)
    dropped = [r["id"] for r in receivers if r["state"] not in ("served", "closed by its receiver")]
    print(
        f"ray actors: {len(receivers)} joined, dropped {dropped} (the killed actor's: {dropped == [killed]}), "
        f"{len(pulled)} pulls, every version whole: {whole}, last version {max(v for v, _ in pulled)}"
    )
    if not whole or dropped != [killed] or len(receivers) != args.actors + 1:
        raise SystemExit("unexpected: see above")


if __name__ == "__main__":
    main()
