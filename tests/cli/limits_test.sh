#!/usr/bin/env bash
# What one message may cost, with the real relay and consumer (README
# "What one caller can cost"): the relay fills a delivery batch to 1 MiB,
# so twelve 600 KiB events go two to a batch; an event of 2.8 MiB still
# goes (its batch is under EventSink's 4 MiB, which the consumer accepts);
# an event over 3 MiB is rejected by the relay itself and becomes a dead
# letter naming its size, while everything else is delivered; a Deliver
# message over 4 MiB is refused by the consumer before it is parsed.
# The consumer runs --handler=audit, which records any event whole.
set -euo pipefail
source "$(dirname "$0")/../lib.sh"
use_workdir limits

orders_db=$(new_db limits_orders)
audit_db=$(new_db limits_audit)
R=$(free_port) C=$(free_port) M=$(free_port)
start consumer outbox-consumer --listen="127.0.0.1:$C" --db="$audit_db" --handler=audit
start relay outbox-relay --listen="127.0.0.1:$R" --db="$orders_db" \
  --consumer="127.0.0.1:$C" --metrics_listen="127.0.0.1:$M" --poll_interval=200ms \
  --retry_max=500ms --max_attempts=2 --reject_backoff=50ms
for port in "$R" "$C"; do wait_serving "$port"; done

# Outbox rows as the writer stores them: a serialized outbox.v1.Event
# holding only its payload (field 13, an Any of N bytes); the relay takes
# the envelope from the columns. All in one transaction, so the relay's
# first claim sees them together.
python3 - "$WORK/events.sql" <<'PY'
import sys

def varint(n):
    out = b""
    while True:
        b = n & 0x7F
        n >>= 7
        out += bytes([b | (0x80 if n else 0)])
        if not n:
            return out

def field(num, data):
    return varint(num << 3 | 2) + varint(len(data)) + data

def event(size, fill):
    value = bytes([fill]) * size
    any_ = field(1, b"type.googleapis.com/limits.Blob") + field(2, value)
    return field(13, any_)

rows = [(f"blob-{i}", 600 << 10, i) for i in range(12)]
rows += [("blob-large", 2800 << 10, 99), ("blob-too-large", 3200 << 10, 100)]
with open(sys.argv[1], "w") as f:
    f.write("BEGIN;\n")
    for i, (agg, size, fill) in enumerate(rows):
        f.write("INSERT INTO outbox (event_id, aggregate_type, aggregate_id, "
                "prev_seq, event_type, schema_version, payload, partition) "
                f"VALUES (gen_random_uuid(), 'blob', '{agg}', 0, 'BlobStored', "
                f"1, decode('{event(size, fill).hex()}', 'hex'), {i % 32});\n")
    f.write("COMMIT;\n")
PY
psql "$orders_db" -q -v ON_ERROR_STOP=1 -f "$WORK/events.sql" >/dev/null ||
  fail "cannot insert the events"

deadline=$((SECONDS + 90))
until [ "$(psql "$audit_db" -qAtc "SELECT count(*) FROM audit_log")" = 13 ] &&
  [ "$(psql "$orders_db" -qAtc "SELECT count(*) FROM outbox_delivery WHERE status = 'dead'")" = 1 ]; do
  [ $SECONDS -lt $deadline ] ||
    fail "not delivered within 90s: $(psql "$audit_db" -qAtc "SELECT count(*) FROM audit_log") of 13 recorded, $(psql "$orders_db" -qAtc "SELECT status || ' ' || coalesce(last_error, '') FROM outbox_delivery")"
  sleep 0.5
done
[ "$(psql "$audit_db" -qAtc "SELECT count(*) FROM audit_log WHERE aggregate_id = 'blob-large'")" = 1 ] ||
  fail "the 2.8 MiB event was not delivered"
dead=$(psql "$orders_db" -qAtc "SELECT o.aggregate_id || ' ' || d.attempts || ' ' || d.last_error FROM outbox_delivery d JOIN outbox o USING (seq) WHERE d.status = 'dead'")
case "$dead" in
  "blob-too-large 2 payload: the event takes "*" bytes; at most 3080192 can be delivered") ;;
  *) fail "dead letter: $dead" ;;
esac
pass "an event over 3 MiB dies at the relay, naming its size; the 2.8 MiB one and the rest are delivered"

batches=$(curl -sf "http://127.0.0.1:$M/metrics" | sed -n 's/^outbox_relay_batches_total{[^}]*} //p')
[ -n "$batches" ] || fail "the relay's metrics have no outbox_relay_batches_total"
# Twelve 600 KiB events, at most two to a batch (the third would start
# past 1 MiB), and the 2.8 MiB one: at least seven batches.
[ "${batches%.*}" -ge 7 ] || fail "$batches batches: the relay filled batches past 1 MiB"
pass "batches filled to 1 MiB: $batches batches for 13 events"

# A Deliver message just over 4 MiB (one event whose aggregate id alone
# is that long) is refused before it is parsed, and writes nothing.
python3 -c 'import json; print(json.dumps({"batchId": "1", "events": [{"eventId": "6f1c2b1e-3c1a-4f7e-9a57-1d2a3b4c5d6e", "aggregateType": "blob", "aggregateId": "a" * ((4 << 20) + 1), "seq": "1", "prevSeq": "0", "eventType": "BlobStored", "schemaVersion": 1}]}))' \
  >"$WORK/big.json"
out=$("$BUF" curl --protocol grpc --http2-prior-knowledge --timeout 20s -d @"$WORK/big.json" \
  "http://127.0.0.1:$C/outbox.v1.EventSink/Deliver" 2>&1 || true)
grep -q resource_exhausted <<<"$out" || fail "a 4 MiB Deliver message: ${out:0:300}"
[ "$(psql "$audit_db" -qAtc "SELECT count(*) FROM inbox")" = 13 ] || fail "the refused message wrote something"
pass "a Deliver message over 4 MiB is refused with RESOURCE_EXHAUSTED"
