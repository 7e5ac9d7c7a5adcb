module deltaq/bench/ack_client

go 1.21
