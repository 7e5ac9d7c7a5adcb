"""The ports a deltaq process is about to listen on, checked before it joins the warehouse or
starts anything: a port another process holds is one line naming the port, its holder where
the system tells, and the setting that moves it."""

from __future__ import annotations

import errno
import os
import socket
from dataclasses import dataclass

from queue_engine.settings import Settings


class PortInUseError(Exception):
    """A port this process needs cannot be listened on; the message says which and why."""


@dataclass(frozen=True)
class Listener:
    what: str  # "HTTP", "TCP (NSQ clients)", "Spark Connect"
    host: str
    port: int
    setting: str  # the setting that changes it, e.g. "port"


def listeners(settings: Settings) -> list[Listener]:
    """What ``deltaq api`` listens on."""
    found = [Listener("HTTP", settings.host, settings.port, "port")]
    if settings.tcp_port:
        found.append(Listener("TCP (NSQ clients)", settings.host, settings.tcp_port, "tcp_port"))
    return found


def spark_connect_listener(settings: Settings) -> list[Listener]:
    """What ``deltaq up``'s jobs listen on besides (Spark Connect, loopback only)."""
    if not settings.spark_connect_port:
        return []
    return [
        Listener("Spark Connect", "127.0.0.1", settings.spark_connect_port, "spark_connect_port")
    ]


def check_ports(wanted: list[Listener]) -> None:
    """Raise ``PortInUseError`` for the first port of ``wanted`` that cannot be listened on."""
    for listener in wanted:
        family = socket.AF_INET6 if ":" in listener.host else socket.AF_INET
        with socket.socket(family, socket.SOCK_STREAM) as probe:
            # As the servers bind: a port left in TIME_WAIT by an earlier run is free.
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                probe.bind((listener.host, listener.port))
            except OSError as exc:
                if exc.errno != errno.EADDRINUSE:
                    raise PortInUseError(
                        f"cannot listen on {listener.host}:{listener.port} for {listener.what}: "
                        f"{exc.strerror}"
                    ) from exc
                holder = port_holder(listener.port)
                env = f"DELTAQ_{listener.setting.upper()}"
                raise PortInUseError(
                    f"port {listener.port} ({listener.what}) is in use"
                    + (f" by {holder}" if holder else "")
                    + f": stop it, or set {listener.setting} ({env}) to another port"
                ) from exc


def port_holder(port: int) -> str | None:
    """Who listens on ``port``, as "deltaq up (pid N)" or "java (pid N)", where the system
    tells (another user's processes may be hidden)."""
    import psutil

    try:
        connections = psutil.net_connections(kind="tcp")
    except (psutil.Error, OSError):
        return None
    for conn in connections:
        if conn.status == psutil.CONN_LISTEN and conn.laddr and conn.laddr.port == port:
            if conn.pid is None:
                return None
            try:
                process = psutil.Process(conn.pid)
                name = _deltaq_command(process.cmdline()) or process.name()
                parent = process.parent()
                owner = _deltaq_command(parent.cmdline()) if parent is not None else None
            except psutil.Error:
                return f"pid {conn.pid}"
            held = f"{name} (pid {conn.pid})"
            # Spark Connect is held by the JVM of a deltaq jobs process.
            return f"{held}, started by {owner} (pid {parent.pid})" if owner and parent else held
    return None


def _deltaq_command(command: list[str]) -> str | None:
    """ "deltaq up" for ``python -m deltaq up --flags`` or ``.../bin/deltaq up``; else None."""
    for i, word in enumerate(command):
        if os.path.basename(word) == "deltaq":
            rest = [w for w in command[i + 1 :] if not w.startswith("-")]
            return f"deltaq {rest[0]}" if rest else "deltaq"
    return None
