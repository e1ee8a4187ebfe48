"""Machine identity: which network host this process is on, and whether two processes may share memory."""

from __future__ import annotations

import hashlib
import os
import socket


def host_id() -> str:
    """Which network host this process is on: the hostname and the network namespace (two
    namespaces on one machine are two hosts to the network: their traffic crosses links)."""
    try:
        net = os.stat("/proc/self/ns/net").st_ino
    except OSError:
        net = 0
    return f"{socket.gethostname()}/{net}"


def machine_key() -> bytes:
    """32 bytes naming this machine's boot, network host and user: two processes can share
    memory only if they agree (and the reader can then open what the writer made)."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = ""
    return hashlib.sha256(f"{boot}|{host_id()}|{os.getuid()}".encode()).digest()
