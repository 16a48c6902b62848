"""Where each actor runs, as the actor itself sees it: its node, the placement group that holds it,
the addresses its process listens on (its gloo groups' devices), and for a learner rank the
learners' world it joined. The driver prints them in one line at start-up
(:func:`placement_line`), so a user of a multi-node cluster sees which node does what."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Sequence

import ray


@dataclass(frozen=True)
class ActorPlace:
    role: str  # generator-0, grader, buffer, learner, learner-1
    node_ip: str  # the node's IP as Ray knows it
    pid: int
    placement_group: str = ""  # hex id of the placement group holding the actor; "" = none
    listens: tuple[str, ...] = ()  # addresses (not the wildcard) its process listens on: its gloo devices
    world: str = ""  # a learner rank: host:port of the learners' world it joined (its MASTER_ADDR:MASTER_PORT)

    def __str__(self) -> str:
        notes = [f"world {self.world}"] if self.world else []
        notes += [f"gloo {','.join(self.listens)}"] if self.listens else []
        notes += [f"placement group {self.placement_group[:8]}"] if self.placement_group else []
        return f"{self.role} on {self.node_ip}" + (f" ({', '.join(notes)})" if notes else "")


def local_ip() -> str:
    """This node's address as Ray knows it (127.0.0.1 where Ray cannot tell): the one every actor binds and reports."""
    try:
        return ray.util.get_node_ip_address()
    except Exception:  # not inside Ray
        return "127.0.0.1"


def listening_addresses() -> tuple[str, ...]:
    """The addresses this process listens on over TCP, the wildcard (``0.0.0.0``, ``::``) left out:
    in an actor, those of its gloo groups (Ray's and the TCP stores' servers listen on the wildcard)."""
    import psutil

    try:
        conns = psutil.Process().net_connections(kind="tcp")
    except (psutil.Error, OSError):  # not permitted here
        return ()
    ips = {c.laddr.ip.removeprefix("::ffff:") for c in conns if c.status == psutil.CONN_LISTEN}
    return tuple(sorted(ips - {"0.0.0.0", "::"}))


def here(role: str, world: str = "") -> ActorPlace:
    """This actor's :class:`ActorPlace`."""
    ctx = ray.get_runtime_context()
    return ActorPlace(role, local_ip(), os.getpid(), ctx.get_placement_group_id() or "",
                      listening_addresses(), world)


def placement_line(places: Sequence[ActorPlace], sync_store: str, backend: str) -> str:
    """``actors: generator-0 on 10.0.0.2 (gloo 10.0.0.2); grader on ...; weight sync: gloo, store 10.0.0.3:4100``."""
    sync = f"weight sync: {backend}" + (f", store {sync_store}" if sync_store else "")
    return "actors: " + "; ".join([*(str(p) for p in places), sync])
