"""Access to the process's broker from a request."""

from __future__ import annotations

from fastapi import Request

from queue_engine.broker import Broker


def broker_of(request: Request) -> Broker:
    broker = request.app.state.broker
    assert isinstance(broker, Broker)
    return broker
