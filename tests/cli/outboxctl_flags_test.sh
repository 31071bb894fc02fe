#!/usr/bin/env bash
# outboxctl --help answers with exit 0, and so do the services' --help and
# --helpfull; no command or an unknown one gets
# the full usage and exit 2; it refuses a flag out of range before it
# contacts anything: exit 2 and a message that names the flag. Nothing listens where it would call
# (port 9 on loopback), so a flag let through fails differently. A flag
# no binary knows, or a value its type refuses, is a usage error too (exit
# 2 naming it) for outboxctl and each service: a check that reads exit 1
# as "violations found" must not take a typo for them.
set -euo pipefail
source "$(dirname "$0")/../lib.sh"

nowhere=127.0.0.1:9
db=postgresql://127.0.0.1:9/none
# refused FLAG ARGS...: outboxctl ARGS exits 2 naming FLAG.
refused() {
  local flag="$1" out rc=0
  shift
  out=$("$BIN/outboxctl" --producer=$nowhere --relay=$nowhere --consumer=$nowhere \
    --orders_db=$db --billing_db=$db "$@" 2>&1) || rc=$?
  [ "$rc" = 2 ] || fail "outboxctl $*: exit $rc, not 2: $out"
  grep -q -- "$flag" <<<"$out" || fail "outboxctl $*: does not name $flag: $out"
  pass "outboxctl $*: $out"
}

# Help is asked for, not a mistake: exit 0, every command and the flags.
for ask in --help -h help; do
  rc=0
  out=$("$BIN/outboxctl" $ask 2>&1) || rc=$?
  [ "$rc" = 0 ] || fail "outboxctl $ask: exit $rc, not 0: $out"
  for want in reconcile replay diverged resolve held subscriptions conformance --orders_db --subscription --sink; do
    grep -q -- "$want" <<<"$out" || fail "outboxctl $ask does not mention $want: $out"
  done
  pass "outboxctl $ask: exit 0, every command and the flags"
done
# No command, or an unknown one: the usage with every command, exit 2.
for cmd in "" frobnicate; do
  rc=0
  out=$("$BIN/outboxctl" $cmd 2>&1) || rc=$?
  [ "$rc" = 2 ] || fail "outboxctl $cmd: exit $rc, not 2: $out"
  for want in stats reconcile replay diverged resolve held subscriptions conformance; do
    grep -q -- "$want" <<<"$out" || fail "outboxctl $cmd: the usage omits $want: $out"
  done
  pass "outboxctl ${cmd:-(no command)}: exit 2 and the usage"
done

# Acting on a held event needs the event and a reason (recorded).
refused --reason held release 0b4e6a5c-2f1d-4c6e-9a1b-3c5d7e9f1a2b
refused --reason held skip
refused "held release|skip" held frobnicate x --reason=y
refused --reason subscriptions pause billing
refused "pause|resume|drop" subscriptions rename billing --reason=y
refused --timeout stats --timeout=0s
refused --timeout show 00000000-0000-0000-0000-000000000000 --timeout=-1s
refused --wait verify --wait=-1s
refused --since requeue --all-dead --since=-1h
refused --limit reconcile --limit=-1
refused --grace reconcile --grace=-5m
refused --concurrency demo --concurrency=0
refused --parallel resolve --all --reason=y --parallel=0
refused --parallel resolve --all --reason=y --parallel=65
refused "resolve --aggregate ID | --all" resolve --reason=y
refused --rate load --orders=10 --rate=-5
refused --pay_fraction load --pay_fraction=1.5
refused --only load --only=refund
refused --max_tries load --max_tries=0
refused --sink conformance
refused --protocol conformance --sink=$nowhere --protocol=3
refused usage no-such-command

# Misspelt or mistyped flags (abseil's own parse would exit 1).
refused --wiat verify --wiat=10s
refused --no_such_flag stats --no_such_flag
refused --timeout stats --timeout
refused --timeout stats --timeout=soon
# The services' help, asked for, is not a failure either (abseil's own
# parse exits 1): exit 0 and their flags.
for b in outbox-producer outbox-relay outbox-consumer; do
  for ask in --help --helpfull; do
    rc=0
    out=$(timeout 10 "$BIN/$b" $ask 2>&1) || rc=$?
    [ "$rc" = 0 ] || fail "$b $ask: exit $rc, not 0: $out"
    grep -q -- "$b" <<<"$out" || fail "$b $ask: does not name the binary: $out"
    grep -q -- "--db_pool_size" <<<"$out" || fail "$b $ask does not list --db_pool_size: $out"
    grep -q -- "--log_level" <<<"$out" || fail "$b $ask does not list --log_level: $out"
    pass "$b $ask: exit 0 and its flags"
  done
  # --help leaves abseil's own flags to --helpfull.
  out=$(timeout 10 "$BIN/$b" --help 2>&1) || :
  if grep -q -- "--flagfile" <<<"$out"; then fail "$b --help lists abseil's --flagfile: $out"; fi
done
for b in outbox-producer outbox-relay outbox-consumer; do
  for args in "--no_such_flag" "--db_pool_size=many" "--db_pool_size" "--nodb_pool_size"; do
    rc=0
    out=$(timeout 10 "$BIN/$b" --db=$db $args 2>&1) || rc=$?
    flag=${args%%=*}
    flag=${flag#--no}
    flag=${flag#--}
    [ "$rc" = 2 ] || fail "$b $args: exit $rc, not 2: $out"
    grep -q -- "$flag" <<<"$out" || fail "$b $args: does not name $flag: $out"
    pass "$b $args: $out"
  done
done
