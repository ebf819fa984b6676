"""Every name users, dashboards and alert rules depend on, defined once.

Dashboards, alert rules and their tests import these names instead of repeating them, so a rename is a
single edit that the test suite follows everywhere.
"""

from __future__ import annotations

from typing import Final

# The namespace of every metric (`kvobs_...`) and recording rule (`kvobs:...`): the rule tests hold both to it.
PREFIX: Final = "kvobs"

# Transfer paths. More may be added; each is a label value and a span name suffix.
PATH_PREFETCH: Final = "prefetch"
PATH_WRITE_BACK: Final = "write_back"
PATH_SEND: Final = "send"
PATH_RECEIVE: Final = "receive"  # the decode node's side of a send: KV arriving into its GPU blocks
PATHS: Final = (PATH_PREFETCH, PATH_WRITE_BACK, PATH_SEND, PATH_RECEIVE)

# Outcomes of one guarded transfer.
OUTCOME_OK: Final = "ok"
OUTCOME_ERROR: Final = "error"
OUTCOME_TIMEOUT: Final = "timeout"
OUTCOME_REJECTED: Final = "rejected"
OUTCOME_ABANDONED: Final = "abandoned"  # never completed before its deadline
TRANSFER_OUTCOMES: Final = (OUTCOME_OK, OUTCOME_ERROR, OUTCOME_TIMEOUT, OUTCOME_REJECTED, OUTCOME_ABANDONED)

# Holders of the cache lock that are not transfers (label `path` of the lock metrics).
HOLDER_FORWARD: Final = "forward"

# Modes of a claim on the cache lock: transfers that read blocks share them, writers exclude.
CLAIM_SHARED: Final = "shared"
CLAIM_EXCLUSIVE: Final = "exclusive"
CLAIM_MODES: Final = (CLAIM_SHARED, CLAIM_EXCLUSIVE)

# Results of one NaN/Inf check.
CHECK_CLEAN: Final = "clean"
CHECK_NAN: Final = "nan"
CHECK_INF: Final = "inf"
CHECK_RESULTS: Final = (CHECK_CLEAN, CHECK_NAN, CHECK_INF)

# Outcomes of one early-signal decision.
SIGNAL_READY: Final = "ready"
SIGNAL_BUFFERED: Final = "buffered"
SIGNAL_RECOVERED: Final = "recovered"
SIGNAL_DROPPED_INVALID: Final = "dropped_invalid"
SIGNAL_DROPPED_FINISHED: Final = "dropped_finished"
SIGNAL_EXPIRED: Final = "expired"
SIGNAL_OVERFLOW: Final = "overflow"
# a registration (or a step-aligned step record) refused because the buffer's bound is reached: tasks never
# finished, or end_step() never called
SIGNAL_REFUSED: Final = "refused"
SIGNAL_OUTCOMES: Final = (
    SIGNAL_READY,
    SIGNAL_BUFFERED,
    SIGNAL_RECOVERED,
    SIGNAL_DROPPED_INVALID,
    SIGNAL_DROPPED_FINISHED,
    SIGNAL_EXPIRED,
    SIGNAL_OVERFLOW,
    SIGNAL_REFUSED,
)

# Label names (low cardinality only: never ids, keys or block numbers).
LABEL_ENGINE: Final = "engine"
LABEL_PATH: Final = "path"
LABEL_OUTCOME: Final = "outcome"
LABEL_LOCK: Final = "lock"
LABEL_RESULT: Final = "result"
LABEL_VERSION: Final = "version"
LABEL_HOLDER_PATH: Final = "holder_path"
LABEL_MODE: Final = "mode"
LABEL_STAGE: Final = "stage"

# Metric names as exposed (counters carry `_total` in exposition; prometheus_client adds it).
TRANSFERS_TOTAL: Final = "kvobs_transfers_total"
TRANSFER_DURATION_SECONDS: Final = "kvobs_transfer_duration_seconds"
TRANSFER_BLOCKS_TOTAL: Final = "kvobs_transfer_blocks_total"
TRANSFER_BYTES_TOTAL: Final = "kvobs_transfer_bytes_total"
TRANSFERS_IN_FLIGHT: Final = "kvobs_transfers_in_flight"
TRANSFER_OLDEST_OPEN_AGE_SECONDS: Final = "kvobs_transfer_oldest_open_age_seconds"
LOCK_WAIT_SECONDS: Final = "kvobs_lock_wait_seconds"
LOCK_HOLD_SECONDS: Final = "kvobs_lock_hold_seconds"
LOCK_TIMEOUTS_TOTAL: Final = "kvobs_lock_timeouts_total"
LOCK_HELD_SECONDS: Final = "kvobs_lock_held_seconds"
LOCK_CONFLICTS_TOTAL: Final = "kvobs_lock_conflicts_total"
LOCK_BLOCKS_CLAIMED: Final = "kvobs_lock_blocks_claimed"
NAN_CHECKS_TOTAL: Final = "kvobs_nan_checks_total"
NAN_BLOCKS_TOTAL: Final = "kvobs_nan_blocks_total"
PENDING_SIGNALS: Final = "kvobs_pending_signals"
PENDING_SIGNAL_OLDEST_AGE_SECONDS: Final = "kvobs_pending_signal_oldest_age_seconds"
SIGNALS_TOTAL: Final = "kvobs_signals_total"
SIGNAL_BUFFERED_SECONDS: Final = "kvobs_signal_buffered_seconds"
BUILD_INFO: Final = "kvobs_build_info"
TELEMETRY_ERRORS_TOTAL: Final = "kvobs_telemetry_errors_total"

# Metric name -> its label names: the contract dashboards and alert rules are written against.
METRIC_LABELS: Final[dict[str, tuple[str, ...]]] = {
    TRANSFERS_TOTAL: (LABEL_ENGINE, LABEL_PATH, LABEL_OUTCOME),
    TRANSFER_DURATION_SECONDS: (LABEL_ENGINE, LABEL_PATH, LABEL_OUTCOME),
    TRANSFER_BLOCKS_TOTAL: (LABEL_ENGINE, LABEL_PATH),
    TRANSFER_BYTES_TOTAL: (LABEL_ENGINE, LABEL_PATH),
    TRANSFERS_IN_FLIGHT: (LABEL_ENGINE, LABEL_PATH),
    TRANSFER_OLDEST_OPEN_AGE_SECONDS: (LABEL_ENGINE, LABEL_PATH),
    LOCK_WAIT_SECONDS: (LABEL_ENGINE, LABEL_LOCK, LABEL_PATH),
    LOCK_HOLD_SECONDS: (LABEL_ENGINE, LABEL_LOCK, LABEL_PATH),
    LOCK_TIMEOUTS_TOTAL: (LABEL_ENGINE, LABEL_LOCK, LABEL_PATH),
    LOCK_HELD_SECONDS: (LABEL_ENGINE, LABEL_LOCK),
    LOCK_CONFLICTS_TOTAL: (LABEL_ENGINE, LABEL_LOCK, LABEL_PATH, LABEL_HOLDER_PATH),
    LOCK_BLOCKS_CLAIMED: (LABEL_ENGINE, LABEL_LOCK, LABEL_MODE),
    NAN_CHECKS_TOTAL: (LABEL_ENGINE, LABEL_PATH, LABEL_RESULT),
    NAN_BLOCKS_TOTAL: (LABEL_ENGINE, LABEL_PATH),
    PENDING_SIGNALS: (LABEL_ENGINE,),
    PENDING_SIGNAL_OLDEST_AGE_SECONDS: (LABEL_ENGINE,),
    SIGNALS_TOTAL: (LABEL_ENGINE, LABEL_OUTCOME),
    SIGNAL_BUFFERED_SECONDS: (LABEL_ENGINE,),
    BUILD_INFO: (LABEL_VERSION,),
    TELEMETRY_ERRORS_TOTAL: (LABEL_ENGINE, LABEL_STAGE),
}

# Histogram buckets in seconds: they start well below a millisecond (an uncontended lock wait is tiny).
DEFAULT_LATENCY_BUCKETS: Final = (
    0.00001, 0.000025, 0.00005, 0.0001, 0.00025, 0.0005,
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0,
)

# Span names and attributes.
SPAN_PREFIX: Final = "kvobs."


def span_name(path: str) -> str:
    """`kvobs.prefetch`, `kvobs.write_back`, `kvobs.send`."""
    return SPAN_PREFIX + path


ATTR_ENGINE: Final = "kvobs.engine"
ATTR_PATH: Final = "kvobs.path"
ATTR_BLOCKS: Final = "kvobs.blocks"
ATTR_BYTES: Final = "kvobs.bytes"
ATTR_KEYS: Final = "kvobs.keys"
ATTR_BLOCK_IDS: Final = "kvobs.block_ids"
ATTR_REQUEST_ID: Final = "kvobs.request_id"
ATTR_REQUEST_IDS: Final = "kvobs.request_ids"  # a batch: the requests one transfer moved (first 64)
ATTR_LOCK_NAME: Final = "kvobs.lock.name"
ATTR_LOCK_WAIT_S: Final = "kvobs.lock.wait_s"
ATTR_LOCK_HOLD_S: Final = "kvobs.lock.hold_s"
ATTR_OUTCOME: Final = "kvobs.outcome"
ATTR_ERROR_TYPE: Final = "error.type"  # OpenTelemetry's own attribute
ATTR_BAD_BLOCK_IDS: Final = "kvobs.integrity.bad_block_ids"
ATTR_SLOT: Final = "kvobs.signal.slot"
ATTR_TOKENS: Final = "kvobs.signal.tokens"
ATTR_NEED_TOKENS: Final = "kvobs.signal.need_tokens"
ATTR_WAITED_S: Final = "kvobs.signal.waited_s"  # how long a dropped signal had waited

# Log fields kvobs adds: how many log lines of one kind a rate-limited log left out since the last one.
LOG_SUPPRESSED: Final = "suppressed"

EVENT_INTEGRITY_BAD_BLOCKS: Final = "kvobs.integrity.bad_blocks"
EVENT_SIGNAL_RECOVERED: Final = "kvobs.signal.recovered"
EVENT_SIGNAL_DROPPED: Final = "kvobs.signal.dropped"

# Environment variables kvobs itself reads (the OTEL_* and PROMETHEUS_MULTIPROC_DIR ones are standard).
ENV_ENABLED: Final = "KVOBS_ENABLED"
ENV_LOCK_TIMEOUT: Final = "KVOBS_LOCK_TIMEOUT"
ENV_TRANSFER_DEADLINE: Final = "KVOBS_TRANSFER_DEADLINE"
ENV_LOCK_DIR: Final = "KVOBS_LOCK_DIR"
ENV_MULTIPROC_DIR: Final = "PROMETHEUS_MULTIPROC_DIR"
