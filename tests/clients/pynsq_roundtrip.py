"""pynsq's Writer publishes N messages and its Reader consumes them; prints what it saw as JSON.

usage: pynsq_roundtrip.py PORT TOPIC N [snappy|deflate|tls CA_FILE]
"""

from __future__ import annotations

import json
import ssl
import sys

import nsq
import tornado.ioloop


def main() -> None:
    port, topic, count = sys.argv[1], sys.argv[2], int(sys.argv[3])
    feature = sys.argv[4] if len(sys.argv) > 4 else ""
    options: dict[str, object] = {}
    if feature == "snappy":
        options["snappy"] = True
    elif feature == "deflate":
        options["deflate"] = True
    elif feature == "tls":
        options["tls_v1"] = True
        # tornado's ssl_options: the server's certificate must verify against this CA.
        options["tls_options"] = {"ca_certs": sys.argv[5], "cert_reqs": ssl.CERT_REQUIRED}
    address = f"127.0.0.1:{port}"
    loop = tornado.ioloop.IOLoop.current()
    got: list[str] = []
    acks: list[str] = []

    def handler(message: nsq.Message) -> bool:
        got.append(message.body.decode())
        if len(got) >= count:
            loop.call_later(0.3, loop.stop)
        return True

    nsq.Reader(
        message_handler=handler,
        nsqd_tcp_addresses=[address],
        topic=topic,
        channel="pynsq",
        max_in_flight=10,
        user_agent="pynsq-roundtrip",
        **options,
    )
    writer = nsq.Writer([address], **options)

    def publish() -> None:
        for i in range(count):
            writer.pub(topic, f"py{i}".encode(), callback=lambda _c, data: acks.append(repr(data)))

    loop.call_later(1.0, publish)
    loop.call_later(60, loop.stop)
    loop.start()
    print(json.dumps({"got": got, "acks": acks}))


if __name__ == "__main__":
    main()
