"""One typed settings object: defaults (nsqd's where nsqd has one) < conf/*.toml < DELTAQ_* env.

Units are in the names. Command-line flags, applied by the CLI, override all three.
"""

from __future__ import annotations

import os
from enum import StrEnum
from pathlib import Path
from typing import Any

from pydantic import Field, model_validator
from pydantic_settings import (
    BaseSettings,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
    TomlConfigSettingsSource,
)

CONFIG_ENV = "DELTAQ_CONFIG"


class TlsRequired(StrEnum):
    FALSE = "false"
    TRUE = "true"
    TCP_HTTPS = "tcp-https"

    @classmethod
    def _missing_(cls, value: object) -> TlsRequired | None:
        # nsqd's flag is a bool flag too: true/false/1/0 in any case, and TOML booleans.
        text = str(value).strip().lower()
        if text in ("true", "1", "t", "yes"):
            return cls.TRUE
        if text in ("false", "0", "f", "no", ""):
            return cls.FALSE
        return cls.TCP_HTTPS if text == "tcp-https" else None


class TlsClientAuthPolicy(StrEnum):
    NONE = ""
    REQUIRE = "require"
    REQUIRE_VERIFY = "require-verify"


class TlsMinVersion(StrEnum):
    TLS1_0 = "tls1.0"
    TLS1_1 = "tls1.1"
    TLS1_2 = "tls1.2"
    TLS1_3 = "tls1.3"


class AckMode(StrEnum):
    """When /pub and /mpub answer OK."""

    # Once the node journal holds it (fsync'd on local disk; one object per write on an object
    # store), before the topic's Delta commit: it survives kill -9 and power loss. The default.
    JOURNAL = "journal"
    # After the Delta commit holding the message succeeded: it survives kill -9.
    COMMIT = "commit"
    # As soon as the message is in the commit buffer (nsqd's guarantee: in memory); it is
    # committed within milliseconds, but a crash in between loses it.
    BUFFER = "buffer"


class RetentionMode(StrEnum):
    """When a topic's rows may be removed."""

    # retention_hours after publishing, and only once every channel has taken them.
    TAKEN = "taken"
    # retention_hours after publishing, whether or not every channel has taken them.
    FIXED = "fixed"


class Settings(BaseSettings):
    """Everything configurable about a deltaq process."""

    model_config = SettingsConfigDict(env_prefix="DELTAQ_", extra="forbid", frozen=True)

    warehouse: str = Field(
        default="deltaq-data",
        description="Root of all tables: a local path or an s3:// abfss:// gs:// URL.",
    )
    host: str = "127.0.0.1"
    port: int = 4151
    # The address /info gives other tools (nsqadmin calls the API there); "": the hostname.
    broadcast_address: str = ""
    # nsqd's TCP protocol (V2), for NSQ's own clients; 0 turns it off.
    tcp_port: int = 4150
    # nsqlookupd TCP addresses (host:port) to register this node's topics and channels with,
    # as nsqd's --lookupd-tcp-address: consumers given lookupd addresses then find it.
    nsqlookupd_tcp_addresses: list[str] = Field(default_factory=list)
    # TLS as nsqd 1.3.0 lays it out (api/tls.py). A certificate and key (PEM files): HTTPS on
    # https_address, beside plain HTTP on port; TCP clients upgrade with IDENTIFY's tls_v1.
    # Empty: no TLS.
    tls_cert: str = ""
    tls_key: str = ""
    # Where HTTPS listens (host:port); "": this host, port 4152 (nsqd's). Only with a cert.
    https_address: str = ""
    # CA file (PEM) client certificates are verified against.
    tls_root_ca_file: str = ""
    # "" (no client certificate asked), "require", "require-verify"; either makes
    # tls_required true, as in nsqd.
    tls_client_auth_policy: TlsClientAuthPolicy = TlsClientAuthPolicy.NONE
    # "false"; "true": TCP clients must upgrade to TLS before anything but IDENTIFY, and plain
    # HTTP answers 403 TLS_REQUIRED; "tcp-https": TCP as "true", plain HTTP still served.
    tls_required: TlsRequired = TlsRequired.FALSE
    # The oldest TLS version accepted: tls1.0 .. tls1.3 (nsqd's default is tls1.0; deltaq's
    # tls1.2, as current OpenSSL builds refuse older ones anyway).
    tls_min_version: TlsMinVersion = TlsMinVersion.TLS1_2
    # Authentication (queue_engine/auth.py): a tokens file (hashed bearer tokens with roles),
    # and/or nsqd's auth server (host:port, or a URL). Both empty: no authentication.
    auth_tokens_file: str = ""
    auth_http_address: str = ""
    # Caps that keep one client from hurting the others (0: no cap).
    max_topics: int = 10_000
    max_channels_per_topic: int = 1_000
    # Long-polling /sub requests waiting at once (each holds a connection), and open TCP
    # connections.
    max_sub_waiters: int = 10_000
    max_tcp_connections: int = 10_000
    # Open HTTP connections (uvicorn's limit_concurrency: one more is answered 503).
    max_http_connections: int = 10_000
    # Serve /pub, /mpub, /sub, /fin, /req and /touch with a plain ASGI handler instead of
    # FastAPI's routing (same answers, about twice the requests per second). Off only to
    # compare or to debug.
    http_fast_path: bool = True
    # nsqd's defaults.
    msg_timeout_ms: int = 60_000
    max_msg_timeout_ms: int = 15 * 60_000
    # Longest defer= and REQ delay. nsqd caps both at an hour because it keeps deferred
    # messages in memory; deltaq's are rows in the ledger and state tables and survive
    # restarts, so the default allows a week.
    max_req_timeout_ms: int = 7 * 24 * 60 * 60_000
    # Most messages one /channel/replay copies (the API holds them in memory to copy them).
    max_replay_messages: int = 100_000
    max_msg_size_bytes: int = 1024 * 1024
    max_body_size_bytes: int = 5 * 1024 * 1024
    max_rdy_count: int = 2500
    # Deliveries a message may have on a channel before it goes to the channel's dead-letter
    # table instead of being delivered again (0: no limit, as nsqd). Channels may override it.
    max_attempts: int = 0
    # Messages not delivered within this many ms of publishing are expired instead (an EXPIRE
    # ledger event; 0: never). Topics may override it.
    message_ttl_ms: int = 0
    # An expired message goes to the channel's dead-letter table (its row's last_event is
    # EXPIRE) instead of only being recorded as expired.
    expired_to_dead_letters: bool = False
    # Retention (the sweep's upkeep, queue_engine/store/upkeep/retention.py): a topic's rows
    # are removed this many hours after publishing (0: kept for ever; Kafka's default is the
    # same week), with "taken" only once every channel has taken them, with "fixed"
    # regardless. Topics may override both.
    retention_hours: float = 168.0
    retention: RetentionMode = RetentionMode.TAKEN
    # A channel's rows (messages table and ledger) are removed this long after the message
    # was FIN'd or expired (0: kept for ever). Live and dead messages keep theirs.
    finished_retention_hours: float = 168.0
    # Seconds between two retention passes of deltaq sweep --every (and deltaq up).
    retention_interval_s: float = 300.0
    # Messages of a channel held in memory (with bodies) ready to deliver; the rest of a backlog
    # stays in the channel table and is read as the window drains (nsqd's mem-queue-size).
    mem_queue_size: int = 10_000
    # A channel's ledger commits the lease events nobody waits on (a TCP consumer's deliveries
    # and FIN/REQ/TOUCH) at most once per this many ms; HTTP /sub and /fin, answered after
    # their commit, commit at once. A commit is two new files: fewer of them under load.
    ledger_linger_ms: int = Field(default=10, ge=0, le=1_000)
    # The API times out expired leases itself, as nsqd's queueScanLoop does, within ~100 ms.
    # False leaves it to the sweep job (then a lease ends within one sweep interval).
    scan_leases: bool = True
    # deltaq up's sweep: seconds between runs (deltaq sweep --every S takes its own S).
    sweep_interval_s: float = 10.0
    # deltaq up serves its jobs' Spark over Spark Connect on 127.0.0.1 at this port (Spark
    # Connect's own default), and deltaq sql uses it when it answers: a query then takes about
    # a second instead of a JVM start. 0: neither.
    spark_connect_port: int = 15002
    # Where the fanout keeps its checkpoint (Spark's streaming format: offsets and commits): a
    # local path, a store URL, or one Spark's Hadoop FileSystem can write (s3a://, hdfs://).
    # "": <warehouse>/_checkpoints/fanout.
    fanout_checkpoint: str = ""
    # On a local master the fanout's batches run in a loop of the jobs process, on Spark's
    # checkpoint (queue_engine/spark/fanout_loop.py); true: as Spark's Structured Streaming
    # query there too (Spark's streaming progress and UI, at 0.2-1.5 s a micro-batch).
    fanout_in_spark: bool = False
    # More Maven coordinates for the jobs' Spark (spark.jars.packages, fetched into Ivy's cache
    # like delta-spark's): org.apache.hadoop:hadoop-aws:<Spark's Hadoop version> lets Spark
    # write an s3a:// fanout checkpoint itself. spark-submit's own --packages apply there.
    spark_packages: list[str] = Field(default_factory=list)
    # Publishing.
    ack: AckMode = AckMode.JOURNAL
    # With ack = "journal": a topic commits at most once per this many ms (its publishes are
    # durable in the journal meanwhile). Longer: fewer, larger commits under load; shorter:
    # messages reach the topic table (and consumers) sooner.
    drain_linger_ms: int = Field(default=50, ge=0, le=10_000)
    # The same for a topic no consumer on this node began waiting for in the last 5 s (at least
    # drain_linger_ms, or object_store_drain_linger_ms on an object store). A topic commit
    # writes and syncs files beside the journal's own fsync'd writes: under deltaq up at 1,000
    # msg/s the /pub ack p99 went from 23-152 ms with commits every 50 ms to 7-18 ms every
    # 250 ms (runs in turn). The price: such a topic's rows reach its table up to this much
    # later, and a consumer that begins waiting makes it commit at once (DrainPacer).
    drain_unwatched_linger_ms: int = Field(default=250, ge=0, le=60_000)
    # The same on an object-store warehouse, where a commit is a few requests of ~20 ms each
    # and every commit file is read again by the next checkpoint: a busy topic commits ~5
    # times a second instead of ~15 (measured on S3's wire protocol: the checkpoints' log reads
    # then no longer hold up the journal's PUTs; publish -> visible grows by ~0.15 s).
    object_store_drain_linger_ms: int = Field(default=200, ge=0, le=10_000)
    # With ack = "journal": about how many topic commits a second the node makes at most; with
    # many busy topics each waits longer (active topics / this, in seconds) and carries more.
    # Each commit costs the same ~2 ms of the node's CPU and two new files however few messages
    # it carries; on two cores publishing to 1,000 busy topics at random went from 0.44x to
    # 0.60x of one topic's rate (and its p99 from ~15 to ~5 ms) between 250 and 100, and
    # under deltaq up from 0.31-0.44x at 100 to 0.59-0.87x at 50 (docs/design.md).
    drain_max_commits_per_s: int = Field(default=50, ge=1)
    # With ack = "journal" on local disk: a journal segment file is closed past this size, and
    # deleted once every publish in it is in its topic's table.
    journal_segment_bytes: int = Field(default=16 * 1024 * 1024, ge=4096)
    # One commit carries at most this many body bytes; more waiting goes in the next commit.
    commit_max_bytes: int = 64 * 1024 * 1024
    # In ack=buffer mode, publishers wait for the commit once this much is buffered (backpressure).
    buffer_max_bytes: int = 64 * 1024 * 1024
    # Table upkeep, all off the publish path.
    # A checkpoint every N commits (Delta's default interval) keeps opening a table fast.
    checkpoint_interval_commits: int = 100
    # ... and at most one per this many seconds: a ledger under load takes ~200 commits a
    # second, and each checkpoint rewrites the table's whole file list (measured: checkpoints
    # every 0.5 s took a fifth of the API's CPU). Readers then replay at most this long's
    # commits, not 100.
    checkpoint_min_interval_s: float = 10.0
    # Compact once a table has this many files smaller than compact_target_file_bytes.
    compact_min_small_files: int = 200
    compact_target_file_bytes: int = 64 * 1024 * 1024
    # At most one compaction of a table per this many seconds: a ledger takes hundreds of
    # commits a second under load, and each compaction rewrites the table's small files.
    compact_interval_s: int = 60
    # Files removed by compaction are deleted only after this long, so a reader that is behind
    # (the fanout job, a Spark query, time travel) never finds its files gone.
    vacuum_retention_hours: int = 168
    vacuum_interval_s: int = 3600
    maintenance_interval_ms: int = 1000
    # The API's table upkeep (checkpoints, compaction, vacuum) in a child process of its own:
    # opening a table replays its log through delta-rs, and in the serving process that memory
    # stays with the allocators. The serving process only decides what is due.
    maintenance_process: bool = True
    # A start opens topics and channels for this long before it serves requests; the rest are
    # opened in the background (a request opens what it needs at once).
    startup_open_budget_s: float = 10.0
    # Object storage: the store's own configuration keys (aws_endpoint_url, aws_region,
    # google_service_account, azure_storage_account_name, ...). Exported into the environment
    # as upper-case names where not already set there (queue_engine/store/storage/object_store.py).
    storage_options: dict[str, str] = Field(default_factory=dict)
    # On an object store, the API holds the warehouse with a lease it renews every third of
    # this; after a kill -9 the next API waits up to this long for it to lapse.
    store_lease_s: float = 15.0

    @model_validator(mode="after")
    def _tls_fits_together(self) -> Settings:
        """nsqd's start-up checks of its TLS options, as one-line refusals."""
        if bool(self.tls_cert) != bool(self.tls_key):
            raise ValueError("tls_cert and tls_key go together: give both or neither")
        required = self.tls_required is not TlsRequired.FALSE or self.tls_client_auth_policy
        if required and not self.tls_cert:
            raise ValueError(
                "cannot require TLS client connections without TLS key and cert "
                "(tls_required, tls_client_auth_policy)"
            )
        if self.https_address:
            _, _, port = self.https_address.rpartition(":")
            if not port.isdigit():
                raise ValueError(f"https_address {self.https_address!r}: host:port")
        return self

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        sources: list[PydanticBaseSettingsSource] = [init_settings, env_settings]
        config = os.environ.get(CONFIG_ENV)
        if config:
            sources.append(TomlConfigSettingsSource(settings_cls, toml_file=Path(config)))
        return tuple(sources)


def load_settings(config_file: str | None = None, **overrides: Any) -> Settings:
    """Settings from ``config_file`` (or $DELTAQ_CONFIG), DELTAQ_* env and ``overrides``.

    ``overrides`` whose value is None are ignored, so CLI flags that were not given do not
    mask the environment or the file.
    """
    given = {key: value for key, value in overrides.items() if value is not None}
    for path in (config_file, os.environ.get(CONFIG_ENV)):
        if path and not Path(path).is_file():
            # pydantic-settings would skip a missing file silently: the defaults would run.
            raise FileNotFoundError(f"settings file not found: {path}")
    if config_file is None:
        return Settings(**given)
    previous = os.environ.get(CONFIG_ENV)
    os.environ[CONFIG_ENV] = config_file
    try:
        return Settings(**given)
    finally:
        if previous is None:
            del os.environ[CONFIG_ENV]
        else:
            os.environ[CONFIG_ENV] = previous
