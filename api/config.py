"""GET and PUT /config/<option>: nsqd's runtime options endpoint.

GET answers the options deltaq has an equivalent for, named and encoded as nsqd does (its
``cfg`` names; durations as Go's ``time.Duration``, integer nanoseconds). PUT changes what
nsqd lets it change: ``log_level`` (it sets the API's logging level) and
``nsqlookupd_tcp_addresses``: the nsqlookupds this node registers with (api/lookupd.py).
"""

from __future__ import annotations

import json
import logging
from typing import Annotated, Any

from fastapi import APIRouter, Path, Request, Response

from api.body import read_limited
from api.responses import JSON_TYPE, NSQ_HEADER, error_body, error_doc, ok_json
from api.state import broker_of
from queue_engine.errors import ErrorCode, QueueError
from queue_engine.settings import Settings

# The most nsqlookupds a node registers with (PUT /config/nsqlookupd_tcp_addresses).
MAX_LOOKUPD_ADDRESSES = 100

router = APIRouter(tags=["info"])

_MS = 1_000_000  # ns per ms: nsqd's durations are encoded in nanoseconds

# nsqd's log levels (its lg package) and the Python levels they set.
LOG_LEVELS = {
    "debug": (1, logging.DEBUG),
    "info": (2, logging.INFO),
    "warn": (3, logging.WARNING),
    "error": (4, logging.ERROR),
    "fatal": (5, logging.CRITICAL),
}
_NSQ_LEVEL = {python: nsq for nsq, python in LOG_LEVELS.values()}

Option = Annotated[str, Path(description="An nsqd option name, e.g. max_msg_size, log_level")]
# What GET answers (the values of _options, plus these two).
OPTIONS = [
    "http_address",
    "tcp_address",
    "data_path",
    "mem_queue_size",
    "max_msg_size",
    "max_body_size",
    "max_rdy_count",
    "msg_timeout",
    "max_msg_timeout",
    "max_req_timeout",
    "tls_cert",
    "tls_key",
    "log_level",
    "nsqlookupd_tcp_addresses",
]


def _options(settings: Settings) -> dict[str, Any]:
    return {
        "http_address": f"{settings.host}:{settings.port}",
        "tcp_address": f"{settings.host}:{settings.tcp_port}",
        "data_path": settings.warehouse,
        "mem_queue_size": settings.mem_queue_size,
        "max_msg_size": settings.max_msg_size_bytes,
        "max_body_size": settings.max_body_size_bytes,
        "max_rdy_count": settings.max_rdy_count,
        "msg_timeout": settings.msg_timeout_ms * _MS,
        "max_msg_timeout": settings.max_msg_timeout_ms * _MS,
        "max_req_timeout": settings.max_req_timeout_ms * _MS,
        "tls_cert": settings.tls_cert,
        "tls_key": settings.tls_key,
    }


def _log_level() -> int:
    level = logging.getLogger().getEffectiveLevel()
    return _NSQ_LEVEL.get(level, 2)


@router.get(
    "/config/{option}",
    summary="One of nsqd's options, as nsqd encodes it",
    response_class=Response,
    responses=error_doc(ErrorCode.INVALID_OPTION),
)
async def get_option(
    request: Request,
    option: Annotated[
        str, Path(description="An nsqd option name", json_schema_extra={"enum": OPTIONS})
    ],
) -> Response:
    return ok_json(_value(request, option))


_PUT_ERRORS: dict[int | str, dict[str, Any]] = {
    **error_doc(ErrorCode.INVALID_VALUE),
    413: {"description": "INVALID_VALUE: empty or longer than max_msg_size"},
}


# The two options PUT can change, each documented with its own body; the generic route below
# answers the rest as nsqd does (INVALID_OPTION).
@router.put(
    "/config/log_level",
    summary="Set the API's logging level",
    response_class=Response,
    responses=_PUT_ERRORS,
    openapi_extra={
        "requestBody": {
            "required": True,
            "content": {"text/plain": {"schema": {"type": "string", "enum": list(LOG_LEVELS)}}},
        }
    },
)
async def put_log_level(request: Request) -> Response:
    return await put_option(request, "log_level")


@router.put(
    "/config/nsqlookupd_tcp_addresses",
    summary="Set the nsqlookupds this node registers its topics and channels with",
    response_class=Response,
    responses=_PUT_ERRORS,
    openapi_extra={
        "requestBody": {
            "required": True,
            "content": {
                "application/json": {
                    "schema": {
                        "type": "array",
                        "items": {"type": "string"},
                        "maxItems": MAX_LOOKUPD_ADDRESSES,
                    }
                }
            },
        }
    },
)
async def put_lookupd(request: Request) -> Response:
    return await put_option(request, "nsqlookupd_tcp_addresses")


@router.put("/config/{option}", include_in_schema=False, response_class=Response)
async def put_option(request: Request, option: Option) -> Response:
    settings = broker_of(request).settings
    try:
        body = await read_limited(
            request.receive, None, settings.max_msg_size_bytes, ErrorCode.INVALID_VALUE
        )
    except QueueError:
        body = b""
    if not body:
        # nsqd: an empty or over-long value is 413 INVALID_VALUE (a bad one is 400).
        return Response(
            error_body(ErrorCode.INVALID_VALUE),
            status_code=413,
            media_type=JSON_TYPE,
            headers=NSQ_HEADER,
        )
    if option == "log_level":
        level = LOG_LEVELS.get(body.decode("utf-8", errors="replace").lower())
        if level is None:
            raise QueueError(ErrorCode.INVALID_VALUE, "log level")
        logging.getLogger().setLevel(level[1])
    elif option == "nsqlookupd_tcp_addresses":
        try:
            addresses = json.loads(body)
        except ValueError as exc:
            raise QueueError(ErrorCode.INVALID_VALUE, "not JSON") from exc
        if not isinstance(addresses, list) or not all(isinstance(a, str) for a in addresses):
            raise QueueError(ErrorCode.INVALID_VALUE, "not a list of strings")
        if len(addresses) > MAX_LOOKUPD_ADDRESSES:
            raise QueueError(
                ErrorCode.INVALID_VALUE, f"more than {MAX_LOOKUPD_ADDRESSES} addresses"
            )
        request.app.state.lookupd_addresses = addresses
        lookupd = getattr(request.app.state, "lookupd", None)
        if lookupd is not None:
            lookupd.set_addresses(addresses)
    else:
        raise QueueError(ErrorCode.INVALID_OPTION, option)
    return ok_json(_value(request, option))


def _value(request: Request, option: str) -> Any:
    if option == "log_level":
        return _log_level()
    if option == "nsqlookupd_tcp_addresses":
        settings = broker_of(request).settings
        return getattr(request.app.state, "lookupd_addresses", settings.nsqlookupd_tcp_addresses)
    options = _options(broker_of(request).settings)
    if option not in options:
        raise QueueError(ErrorCode.INVALID_OPTION, option)
    return options[option]
