#!/usr/bin/env bash
# Mutual TLS on every link with real certificates: the relay with its
# certificate delivers; TLS without client certificates is refused at
# start unless meant (--tls_no_client_auth), and then takes no delivery; a client of the same CA with an identity that is
# not admitted gets PERMISSION_DENIED on Deliver and writes nothing; a
# client with no certificate, a certificate of another CA, or plaintext
# reaches no method, and the server's TLS stack names why; Requeue from a
# read-only identity is denied; oversized requests are refused before they
# are parsed; a relay delivers nothing to a consumer whose certificate is
# of another CA or names another host; rotated certificates and CA
# bundles are picked up without a restart: the consumer's server
# certificate, its client CA bundle, the relay's client certificate and
# its bundle of the consumer's CAs.
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
consumer=$LAST_PID
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
grep -q permission_denied <<<"$out" || fail "intruder on Deliver: $out"
grep -q "spiffe://outbox/intruder" <<<"$out" || fail "refusal does not name the identity: $out"
grep -q "refused EventSink.Deliver .*spiffe://outbox/intruder" "$WORK/consumer.log" ||
  fail "the consumer did not log the refused identity"
[ "$(psql "$billing_db" -qAtc "SELECT count(*) FROM inbox")" = "$applied" ] ||
  fail "the intruder's event was written"
out=$(rpc_as reader "$C" outbox.v1.EventSink/Deliver "$forged")
grep -q permission_denied <<<"$out" || fail "reader on Deliver: $out"
[ "$(psql "$billing_db" -qAtc "SELECT count(*) FROM inbox")" = "$applied" ] ||
  fail "the reader's event was written"
pass "same CA, identity not admitted (or admitted for queries only): PERMISSION_DENIED on Deliver, logged, nothing written"

# TLS that authenticates nobody is refused at start, by every binary,
# naming both ways out; meant (--tls_no_client_auth), a consumer serves
# its API but takes no delivery from a client nobody authenticated.
for spec in producer:outbox-producer relay:outbox-relay consumer:outbox-consumer; do
  who=${spec%%:*} bin=${spec#*:}
  rc=0
  out=$(timeout 30 "$BIN/$bin" --listen="127.0.0.1:$(free_port)" --db="$billing_db" \
    --tls_cert="$CERTS/$who.crt" --tls_key="$CERTS/$who.key" 2>&1) || rc=$?
  [ "$rc" = 2 ] || fail "$bin with --tls_cert and no --tls_client_ca exited $rc: $out"
  grep -q -- "--tls_client_ca" <<<"$out" && grep -q -- "--tls_no_client_auth" <<<"$out" ||
    fail "$bin's refusal names neither way out: $out"
done
C4=$(free_port)
start consumer4 outbox-consumer --listen="127.0.0.1:$C4" --db="$billing_db" \
  --tls_cert="$CERTS/consumer.crt" --tls_key="$CERTS/consumer.key" --tls_no_client_auth
deadline=$((SECONDS + 60))
until rpc_as - "$C4" grpc.health.v1.Health/Check | grep -q '"SERVING"'; do
  [ $SECONDS -lt $deadline ] || fail "the consumer with --tls_no_client_auth did not serve: $(tail -3 "$WORK/consumer4.log")"
  sleep 0.2
done
grep -q "TLS without client certificates" "$WORK/consumer4.log" ||
  fail "the consumer did not warn that nobody is authenticated: $(head -5 "$WORK/consumer4.log")"
for who in - relay; do
  out=$(rpc_as "$who" "$C4" outbox.v1.EventSink/Deliver "$forged")
  grep -q unauthenticated <<<"$out" || fail "Deliver without client authentication ($who): $out"
  grep -q -- "--tls_client_ca" <<<"$out" || fail "the refusal does not say what is missing: $out"
done
[ "$(psql "$billing_db" -qAtc "SELECT count(*) FROM inbox")" = "$applied" ] ||
  fail "an event from an unauthenticated client was written"
out=$(rpc_as - "$C4" outbox.v1.BillingQuery/GetStats)
grep -qi unauthenticated <<<"$out" && fail "the query API refused a TLS client: $out"
kill "$LAST_PID"
pass "TLS without client certificates: refused at start unless meant; then no delivery, nothing written"

# refused NAME PORT WHY CALL...: CALL (a health check) does not reach the
# server on PORT, and the server's log (NAME.log) gains a TLS handshake
# failure saying WHY; a client with a certificate is served meanwhile, so
# the refusal is the handshake's and not a dead port's.
refused() {
  local name="$1" port="$2" why="$3" before out deadline
  shift 3
  before=$(grep -c -- "$why" "$WORK/$name.log" || true)
  out=$("$@" 2>&1) || true
  grep -q SERVING <<<"$out" && fail "$name :$port served a client that should fail with \"$why\""
  deadline=$((SECONDS + 20))
  until [ "$(grep -c -- "$why" "$WORK/$name.log" || true)" -gt "$before" ]; do
    [ $SECONDS -lt $deadline ] || fail "$name :$port did not log \"$why\" for $*: ${out:0:300}"
    sleep 0.2
  done
  rpc_as reader "$port" grpc.health.v1.Health/Check | grep -q '"SERVING"' ||
    fail "$name :$port does not serve a client with a certificate either"
}
rogue_health() {
  "$BUF" curl --protocol grpc --timeout 5s --cacert "$CERTS/ca.crt" \
    --cert "$WORK/rogue/relay.crt" --key "$WORK/rogue/relay.key" \
    -d '{}' "https://localhost:$1/grpc.health.v1.Health/Check"
}
for pair in "producer:$P" "relay:$R" "consumer:$C"; do
  name=${pair%%:*} port=${pair#*:}
  refused "$name" "$port" "peer did not return a certificate" rpc_as - "$port" grpc.health.v1.Health/Check
  refused "$name" "$port" "certificate verify failed" rogue_health "$port"
  refused "$name" "$port" "wrong version number" rpc "$port" grpc.health.v1.Health/Check
done
pass "no certificate, another CA's certificate, or plaintext: refused in the handshake, and the server says why"

out=$(rpc_as reader "$R" outbox.v1.RelayAdmin/Requeue '{"allDead":true}')
grep -q permission_denied <<<"$out" || fail "reader's Requeue: $out"
out=$(rpc_as reader "$R" outbox.v1.RelayAdmin/GetStats)
grep -q '"partitionsTotal"' <<<"$out" || fail "reader's GetStats: $out"
out=$("$BIN/outboxctl" requeue "${ctl[@]}" --relay="localhost:$R" --all-dead)
[ "$out" = "requeued 0 dead letters" ] || fail "admin's requeue: $out"
pass "Requeue: denied to the read-only identity, allowed to the admin identity"

big=$(head -c 100000 /dev/zero | tr '\0' 'a')
out=$(rpc_as outboxctl "$P" outbox.v1.OrderService/CreateOrder \
  "{\"customerId\":\"$big\",\"currency\":\"EUR\",\"items\":[{\"sku\":\"a\",\"quantity\":1}]}")
grep -q resource_exhausted <<<"$out" || fail "100 KB CreateOrder: $out"
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

# The relay checks the consumer: delivering two more subscriptions of the
# same outbox, one relay trusts only another CA (the consumer's certificate
# does not chain to it), the other dials a consumer whose certificate (of
# the right CA) names another host. Each tries again and again (its log
# says why each handshake failed) and delivers nothing: every event stays
# pending for its subscription, the second consumer's inbox stays empty.
billing_db3=$(new_db tls_billing3)
C3=$(free_port) RA=$(free_port) RB=$(free_port)
( source "$OUTBOX_ROOT/scripts/lib/certs.sh"; make_cert_san "$CERTS" elsewhere DNS:elsewhere.example ) >/dev/null
start consumer3 outbox-consumer --listen="127.0.0.1:$C3" --db="$billing_db3" \
  --tls_cert="$CERTS/elsewhere.crt" --tls_key="$CERTS/elsewhere.key" --tls_client_ca="$CERTS/ca.crt"
for spec in "wrongca:$RA:localhost:$C:$WORK/rogue/ca.crt" "wrongname:$RB:localhost:$C3:$CERTS/ca.crt"; do
  IFS=: read -r sub port host cport ca <<<"$spec"
  # gRPC's own debug lines name a failed host name check.
  GRPC_VERBOSITY=DEBUG start "relay-$sub" outbox-relay --listen="127.0.0.1:$port" \
    --db="$orders_db" --subscription="$sub" --consumer="$host:$cport" --consumer_ca="$ca" \
    --client_cert="$CERTS/relay.crt" --client_key="$CERTS/relay.key" \
    --poll_interval=200ms --retry_max=500ms --log_level=debug
done
events=$(psql "$orders_db" -qAtc "SELECT count(*) FROM outbox")
for spec in "wrongca:certificate verify failed" "wrongname:Hostname Verification Check failed"; do
  sub=${spec%%:*} why=${spec#*:}
  deadline=$((SECONDS + 60))
  until [ "$(grep -c -- "$why" "$WORK/relay-$sub.log" || true)" -ge 3 ]; do
    [ $SECONDS -lt $deadline ] || fail "relay-$sub did not try and refuse the consumer 3 times ($why): $(tail -3 "$WORK/relay-$sub.log")"
    sleep 0.2
  done
  pending=$(psql "$orders_db" -qAtc "SELECT count(*) FROM outbox_delivery WHERE subscription = '$sub' AND status = 'pending' AND attempts = 0")
  [ "$pending" = "$events" ] || fail "relay-$sub delivered to a consumer it must not trust: $pending of $events pending"
done
[ "$(psql "$billing_db3" -qAtc "SELECT count(*) FROM inbox")" = 0 ] ||
  fail "the consumer with another host's name received events"
pass "a relay delivers nothing to a consumer whose certificate is of another CA or names another host"

# Rotation of CA bundles and client certificates, none restarted:
# 1. The consumer's client CA bundle gains a second CA: a client of that
#    CA, refused before, is admitted.
( source "$OUTBOX_ROOT/scripts/lib/certs.sh"
  make_ca "$WORK/ca2" && make_cert "$WORK/ca2" reader && make_cert "$WORK/ca2" consumer ) >/dev/null ||
  fail "cannot make the second CA"
ca2_health() {
  "$BUF" curl --protocol grpc --timeout 5s --cacert "$CERTS/ca.crt" \
    --cert "$WORK/ca2/reader.crt" --key "$WORK/ca2/reader.key" \
    -d '{}' "https://localhost:$C/grpc.health.v1.Health/Check" 2>&1 || true
}
refused consumer "$C" "certificate verify failed" ca2_health
cat "$CERTS/ca.crt" "$WORK/ca2/ca.crt" >"$CERTS/ca.crt.new"
mv "$CERTS/ca.crt.new" "$CERTS/ca.crt"
deadline=$((SECONDS + 30))
until ca2_health | grep -q '"SERVING"'; do
  [ $SECONDS -lt $deadline ] || fail "the consumer still refuses the added CA's client: $(ca2_health)"
  sleep 0.5
done
pass "a CA added to the consumer's client CA bundle is trusted without a restart"

# 2. The consumer's server certificate is re-issued by the second CA, and
#    the relay's client certificate under a new identity. A consumer
#    restarted to admit only that identity to Deliver gets the events:
#    the relay re-read both its bundle of the consumer's CAs (now holding
#    the second) and its own certificate.
fingerprint() { openssl x509 -noout -fingerprint -sha256 -in "$1"; }
served() {
  openssl s_client -alpn h2 -connect "127.0.0.1:$C" -CAfile "$CERTS/ca.crt" \
    -cert "$CERTS/reader.crt" -key "$CERTS/reader.key" </dev/null 2>/dev/null |
    openssl x509 -noout -fingerprint -sha256
}
( source "$OUTBOX_ROOT/scripts/lib/certs.sh"; make_cert "$CERTS" relay spiffe://outbox/relay-next ) >/dev/null
cp "$WORK/ca2/consumer.key" "$CERTS/consumer.key.new"
cp "$WORK/ca2/consumer.crt" "$CERTS/consumer.crt.new"
mv "$CERTS/consumer.key.new" "$CERTS/consumer.key"
mv "$CERTS/consumer.crt.new" "$CERTS/consumer.crt"
deadline=$((SECONDS + 30))
until [ "$(served)" = "$(fingerprint "$WORK/ca2/consumer.crt")" ]; do
  [ $SECONDS -lt $deadline ] || fail "the consumer does not serve its certificate of the second CA"
  sleep 0.5
done
kill -TERM "$consumer"
wait "$consumer" || true
start consumer-next outbox-consumer --listen="127.0.0.1:$C" --db="$billing_db" $(server consumer) \
  --allowed_clients=spiffe://outbox/relay-next,spiffe://outbox/reader \
  --delivery_clients=spiffe://outbox/relay-next
"$BIN/outboxctl" load "${ctl[@]}" --producer="localhost:$P" --orders=10 \
  --concurrency=2 --timeout=3s --seed=3 >"$WORK/load3.out" 2>&1 || fail "$(cat "$WORK/load3.out")"
"$BIN/outboxctl" verify --orders_db="$orders_db" --billing_db="$billing_db" \
  --wait=60s >"$WORK/verify3.out" || fail "not delivered after the relay's rotation: $(cat "$WORK/verify3.out")"
grep -q "refused EventSink.Deliver .*spiffe://outbox/relay-next" "$WORK/consumer-next.log" &&
  fail "the consumer refused the relay's new identity"
pass "the relay presents its rotated client certificate and trusts its rotated CA bundle, without a restart"
