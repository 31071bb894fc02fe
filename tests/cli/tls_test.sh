#!/usr/bin/env bash
# Mutual TLS on every link with real certificates: the relay with its
# certificate delivers; a client of the same CA with an identity that is
# not admitted gets PERMISSION_DENIED on Deliver and writes nothing; a
# client with no certificate, a certificate of another CA, or plaintext
# reaches no method; Requeue from a read-only identity is denied; oversized
# requests are refused before they are parsed; a rotated certificate is
# picked up without a restart.
set -euo pipefail
source "$(dirname "$0")/../lib.sh"
use_workdir tls
use_certs reader intruder
( source "$OUTBOX_ROOT/scripts/lib/certs.sh"
  make_ca "$WORK/rogue" && make_cert "$WORK/rogue" relay ) >/dev/null ||
  fail "cannot make the rogue CA"

orders_db=$(new_db tls_orders)
billing_db=$(new_db tls_billing)
P=$(free_port) R=$(free_port) C=$(free_port)
server() { echo --tls_cert="$CERTS/$1.crt" --tls_key="$CERTS/$1.key" --tls_client_ca="$CERTS/ca.crt"; }
start consumer outbox-consumer --listen="127.0.0.1:$C" --db="$billing_db" $(server consumer) \
  --allowed_clients=spiffe://outbox/relay,spiffe://outbox/reader \
  --delivery_clients=spiffe://outbox/relay
start producer outbox-producer --listen="127.0.0.1:$P" --db="$orders_db" $(server producer) \
  --allowed_clients=spiffe://outbox/outboxctl,spiffe://outbox/reader
start relay outbox-relay --listen="127.0.0.1:$R" --db="$orders_db" $(server relay) \
  --allowed_clients=spiffe://outbox/reader --admin_clients=spiffe://outbox/outboxctl \
  --consumer="localhost:$C" --consumer_ca="$CERTS/ca.crt" \
  --client_cert="$CERTS/relay.crt" --client_key="$CERTS/relay.key" \
  --poll_interval=200ms --retry_max=500ms
for port in "$P" "$R" "$C"; do
  # Generous: a loaded CI machine runs other tests beside this one.
  deadline=$((SECONDS + 90))
  until rpc_as reader "$port" grpc.health.v1.Health/Check | grep -q '"SERVING"'; do
    [ $SECONDS -lt $deadline ] || fail "port $port not SERVING over mutual TLS"
    sleep 0.2
  done
done
pass "every server answers health over mutual TLS"

ctl=(--ca="$CERTS/ca.crt" --cert="$CERTS/outboxctl.crt" --key="$CERTS/outboxctl.key")
"$BIN/outboxctl" load "${ctl[@]}" --producer="localhost:$P" --orders=40 \
  --concurrency=2 --timeout=3s >"$WORK/load.out" 2>&1 || fail "load: $(cat "$WORK/load.out")"
"$BIN/outboxctl" verify --orders_db="$orders_db" --billing_db="$billing_db" \
  --wait=60s >"$WORK/verify.out" || fail "$(cat "$WORK/verify.out")"
pass "the relay with its certificate delivered every event"

applied=$(psql "$billing_db" -qAtc "SELECT count(*) FROM inbox")
forged='{"batchId":"1","events":[{"eventId":"6f1c2b1e-3c1a-4f7e-9a57-1d2a3b4c5d6e","aggregateType":"order","aggregateId":"x","seq":"999999","prevSeq":"0","eventType":"OrderCreated","schemaVersion":1}]}'
out=$(rpc_as intruder "$C" outbox.v1.EventSink/Deliver "$forged")
echo "$out" | grep -q permission_denied || fail "intruder on Deliver: $out"
echo "$out" | grep -q "spiffe://outbox/intruder" || fail "refusal does not name the identity: $out"
grep -q "refused EventSink.Deliver .*spiffe://outbox/intruder" "$WORK/consumer.log" ||
  fail "the consumer did not log the refused identity"
[ "$(psql "$billing_db" -qAtc "SELECT count(*) FROM inbox")" = "$applied" ] ||
  fail "the intruder's event was written"
out=$(rpc_as reader "$C" outbox.v1.EventSink/Deliver "$forged")
echo "$out" | grep -q permission_denied || fail "reader on Deliver: $out"
[ "$(psql "$billing_db" -qAtc "SELECT count(*) FROM inbox")" = "$applied" ] ||
  fail "the reader's event was written"
pass "same CA, identity not admitted (or admitted for queries only): PERMISSION_DENIED on Deliver, logged, nothing written"

for port in "$P" "$R" "$C"; do
  out=$(rpc_as - "$port" grpc.health.v1.Health/Check)
  echo "$out" | grep -q SERVING && fail "no client certificate reached :$port"
  out=$("$BUF" curl --protocol grpc --timeout 5s --cacert "$CERTS/ca.crt" \
    --cert "$WORK/rogue/relay.crt" --key "$WORK/rogue/relay.key" \
    -d '{}' "https://localhost:$port/grpc.health.v1.Health/Check" 2>&1) || true
  echo "$out" | grep -q SERVING && fail "another CA's certificate reached :$port"
  out=$(rpc "$port" grpc.health.v1.Health/Check) || true
  echo "$out" | grep -q SERVING && fail "plaintext reached :$port"
done
pass "no certificate, another CA's certificate, or plaintext: no method reachable"

out=$(rpc_as reader "$R" outbox.v1.RelayAdmin/Requeue '{"allDead":true}')
echo "$out" | grep -q permission_denied || fail "reader's Requeue: $out"
out=$(rpc_as reader "$R" outbox.v1.RelayAdmin/GetStats)
echo "$out" | grep -q '"partitionsTotal"' || fail "reader's GetStats: $out"
out=$("$BIN/outboxctl" requeue "${ctl[@]}" --relay="localhost:$R" --all-dead)
[ "$out" = "requeued 0 dead letters" ] || fail "admin's requeue: $out"
pass "Requeue: denied to the read-only identity, allowed to the admin identity"

big=$(head -c 100000 /dev/zero | tr '\0' 'a')
out=$(rpc_as outboxctl "$P" outbox.v1.OrderService/CreateOrder \
  "{\"customerId\":\"$big\",\"currency\":\"EUR\",\"items\":[{\"sku\":\"a\",\"quantity\":1}]}")
echo "$out" | grep -q resource_exhausted || fail "100 KB CreateOrder: $out"
pass "a request over 64 KiB is refused before it is parsed"

serial() {
  openssl s_client -alpn h2 -connect "127.0.0.1:$C" -CAfile "$CERTS/ca.crt" \
    -cert "$CERTS/reader.crt" -key "$CERTS/reader.key" </dev/null 2>/dev/null |
    openssl x509 -noout -serial
}
before=$(serial)
( source "$OUTBOX_ROOT/scripts/lib/certs.sh"; make_cert "$CERTS" consumer ) >/dev/null
deadline=$((SECONDS + 20))
until [ "$(serial)" != "$before" ]; do
  [ $SECONDS -lt $deadline ] || fail "the consumer still presents the old certificate"
  sleep 1
done
"$BIN/outboxctl" load "${ctl[@]}" --producer="localhost:$P" --orders=10 \
  --concurrency=2 --timeout=3s --seed=2 >"$WORK/load2.out" 2>&1 || fail "$(cat "$WORK/load2.out")"
"$BIN/outboxctl" verify --orders_db="$orders_db" --billing_db="$billing_db" \
  --wait=60s >"$WORK/verify2.out" || fail "$(cat "$WORK/verify2.out")"
pass "a rotated certificate is served without a restart, and delivery goes on"
