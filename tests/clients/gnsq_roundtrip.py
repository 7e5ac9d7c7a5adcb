"""gnsq's Producer publishes N messages (PUB and MPUB) and its Consumer consumes them; prints
what it saw as JSON.

usage: gnsq_roundtrip.py PORT TOPIC N [deflate|snappy]
"""

from __future__ import annotations

import json
import sys

import gevent
import gnsq


def main() -> None:
    port, topic, count = sys.argv[1], sys.argv[2], int(sys.argv[3])
    feature = sys.argv[4] if len(sys.argv) > 4 else ""
    address = f"127.0.0.1:{port}"
    options = {feature: True} if feature else {}
    # gnsq 1.0.2's Producer cannot negotiate compression with nsqd 1.3.0 either (its response
    # queue is not set up during the upgrade): only the consumer compresses.
    producer = gnsq.Producer([address])
    producer.start()
    consumer = gnsq.Consumer(topic, "gnsq", [address], max_in_flight=8, **options)
    got: list[str] = []

    @consumer.on_message.connect
    def handler(_consumer: gnsq.Consumer, message: gnsq.Message) -> None:
        got.append(message.body.decode())

    consumer.start(block=False)
    gevent.sleep(0.5)
    half = count // 2
    acks = [producer.publish(topic, f"g{i}".encode()) for i in range(half)]
    acks.append(producer.multipublish(topic, [f"g{i}".encode() for i in range(half, count)]))
    waited = 0.0
    while len(got) < count and waited < 60:
        gevent.sleep(0.1)
        waited += 0.1
    gevent.sleep(0.3)
    consumer.close()
    producer.close()
    print(json.dumps({"got": got, "acks": [a.decode() for a in acks]}))


if __name__ == "__main__":
    main()
