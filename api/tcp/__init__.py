"""nsqd's TCP protocol (V2): NSQ's own clients (go-nsq, pynsq, gnsq, nsq_tail...) publish and
consume through deltaq unchanged, on the same channels and ledgers as the HTTP consumers."""
