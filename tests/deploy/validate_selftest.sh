#!/usr/bin/env bash
# Proves that tests/deploy/validate.sh catches the mistakes it is meant to:
# copies deploy/, .dockerignore and the checks into a scratch tree, breaks
# one thing at a time and expects validate.sh to fail naming the problem;
# and checks that the documented variants of the JetStream mode pass.
#
# Usage: tests/deploy/validate_selftest.sh [BIN_DIR]   (from any directory; exit 0/1)
#   BIN_DIR  the built binaries, passed on to validate.sh, whose flags come
#            from their --helpfull (default: build/bin of the repository).
#            Besides, cases run validate.sh with fake binaries, to prove
#            that their --helpfull is what decides, and without binaries, to
#            prove that it then fails rather than guesses.
set -euo pipefail

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
root=$(cd "$here/../.." && pwd)
bin_dir=${1:-$root/build/bin}
for b in outbox-producer outbox-relay outbox-consumer outboxctl; do
  [[ -x "$bin_dir/$b" ]] || { echo "validate_selftest: $bin_dir/$b is missing (build it, or pass BIN_DIR)" >&2; exit 1; }
done
bin_dir=$(cd "$bin_dir" && pwd)
[[ -d "$here/node_modules" ]] || { echo "validate_selftest: run 'npm ci' in $here" >&2; exit 1; }
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
# Each binary's --helpfull is read once for all the cases (tests/deploy/lib/flags.mjs).
export OUTBOX_HELPFULL_CACHE="$tmp/helpfull"
# Each rendered document is parsed once (tests/deploy/lib/k8s.mjs).
export OUTBOX_YAML_CACHE="$tmp/yaml"
mkdir -p "$OUTBOX_YAML_CACHE"

# A scratch copy of what validate.sh reads; the npm packages are linked,
# not copied.
# fresh [DIR]: the copy in DIR (default $tmp/t).
fresh() {
  local t=${1:-$tmp/t}
  rm -rf "$t"
  mkdir -p "$t/tests/deploy"
  cp -r "$root/deploy" "$t/deploy"
  (cd "$root/tests/deploy" && tar -cf - --exclude=./node_modules .) | tar -xf - -C "$t/tests/deploy"
  ln -s "$root/tests/deploy/node_modules" "$t/tests/deploy/node_modules"
  cp "$root/.dockerignore" "$t/.dockerignore"
}

passed=0
failed=0
# Mutations run in the background, SELFTEST_JOBS (default 2) at a time,
# each in a scratch copy of its own (they are independent and each run of
# validate.sh is CPU-bound); their verdicts are gathered, in order, before
# the summary. The other cases run in the foreground in $tmp/t.
jobs_max=${SELFTEST_JOBS:-2}
mutations=0
mkdir -p "$tmp/verdicts"
# mutate NAME EXPECTED-OUTPUT-REGEX FILE PYTHON-EXPRESSION-ON-s
mutate() {
  mutations=$((mutations + 1))
  while [[ $(jobs -rp | wc -l) -ge $jobs_max ]]; do wait -n || :; done
  mutation "$(printf '%04d' "$mutations")" "$@" &
}
mutation() {
  local id=$1 name=$2 expect=$3 file=$4 expr=$5
  local t="$tmp/m$id" verdict="$tmp/verdicts/$id"
  fresh "$t"
  if ! python3 - "$t/$file" "$expr" <<'PY' 2>"$verdict.err"
import sys
path, expr = sys.argv[1], sys.argv[2]
s = open(path).read()
new = eval(expr, {"s": s})
if new == s:
    sys.exit("mutation changed nothing")
open(path, "w").write(new)
PY
  then
    { echo "FAIL $name: the mutation itself failed:"; sed 's/^/     /' "$verdict.err"; } >"$verdict"
    rm -rf "$t"
    return 0
  fi
  local out rc=0
  out=$("$t/tests/deploy/validate.sh" "$bin_dir" 2>&1) || rc=$?
  if [[ $rc -ne 0 ]] && grep -Eq -- "$expect" <<<"$out"; then
    echo "ok   $name" >"$verdict"
  else
    { echo "FAIL $name: validate.sh exited $rc; expected a failure matching /$expect/; output:"
      tail -n 15 <<<"$out" | sed 's/^/     /'; } >"$verdict"
  fi
  rm -rf "$t"
}
# The mutations' verdicts, once all have run.
mutation_verdicts() {
  wait
  local v seen=0
  for v in "$tmp"/verdicts/[0-9]*; do
    [[ $v == *.err ]] && continue
    seen=$((seen + 1))
    cat "$v"
    if grep -q '^ok ' "$v"; then passed=$((passed + 1)); else failed=$((failed + 1)); fi
  done
  if [[ $seen -lt $mutations ]]; then
    failed=$((failed + mutations - seen))
    echo "FAIL $((mutations - seen)) mutations left no verdict"
  fi
}

# The unmodified tree passes.
fresh
if "$tmp/t/tests/deploy/validate.sh" "$bin_dir" >/dev/null 2>&1; then
  passed=$((passed + 1)); echo "ok   unmodified tree passes"
else
  failed=$((failed + 1)); echo "FAIL unmodified tree does not pass"
fi

B=deploy/k8s/base
mutate "misspelt field" "readinesProbe: unknown field" $B/producer.yaml \
  's.replace("readinessProbe:", "readinesProbe:", 1)'
mutate "probe on a wrong port" "readinessProbe.grpc.port 8087 equals the --health_listen port 8086" $B/producer.yaml \
  's.replace("readinessProbe:\n            grpc:\n              port: 8086", "readinessProbe:\n            grpc:\n              port: 8087", 1)'
mutate "probe on the TLS port" "readinessProbe.grpc.port 50051 is not the --listen port 50051, which serves mutual TLS" $B/producer.yaml \
  's.replace("readinessProbe:\n            grpc:\n              port: 8086", "readinessProbe:\n            grpc:\n              port: 50051", 1)'
mutate "http probe instead of grpc" "livenessProbe is a grpc probe" $B/consumer.yaml \
  's.replace("livenessProbe:\n            grpc:\n              port: 8086\n              service: liveness", "livenessProbe:\n            tcpSocket:\n              port: 8086", 1)'
mutate "liveness probe on readiness" "livenessProbe checks the health service \"liveness\"" $B/relay.yaml \
  's.replace("              service: liveness\n", "", 1)'
mutate "readiness probe on liveness" "readinessProbe checks the overall health service" $B/relay.yaml \
  's.replace("readinessProbe:\n            grpc:\n              port: 8086\n", "readinessProbe:\n            grpc:\n              port: 8086\n              service: liveness\n", 1)'
mutate "no health port" "--health_listen is set \(TLS on --listen" $B/relay.yaml \
  's.replace("            - --health_listen=0.0.0.0:8086\n", "", 1)'
mutate "health port published by a Service" "Service outbox-producer port 8086 does not publish the plaintext health port" $B/producer.yaml \
  's.replace("      appProtocol: grpc\n", "      appProtocol: grpc\n    - name: health\n      port: 8086\n      targetPort: health\n      protocol: TCP\n", 1)'
mutate "health port open to the namespace" "another pod of the namespace -> outbox-producer:8086/TCP is denied" $B/networkpolicy.yaml \
  's.replace("  ingress:\n    - ports:\n        - port: grpc\n          protocol: TCP\n", "  ingress:\n    - ports:\n        - port: grpc\n          protocol: TCP\n        - port: health\n          protocol: TCP\n", 1)'
mutate "listen on loopback" "--listen binds all addresses" $B/relay.yaml \
  's.replace("--listen=0.0.0.0:50052", "--listen=127.0.0.1:50052", 1)'
mutate "listen port changed, probes not" "declares the --listen port 50061" $B/producer.yaml \
  's.replace("--listen=0.0.0.0:50051", "--listen=0.0.0.0:50061", 1)'
mutate "metrics annotation mismatch" "prometheus.io/port equals the metrics port 9090" $B/relay.yaml \
  's.replace("prometheus.io/port: \"9090\"", "prometheus.io/port: \"9091\"", 1)'
mutate "grace period too short" "terminationGracePeriodSeconds 20 > preStop sleep 5 s \+ --shutdown_timeout 20 s" $B/producer.yaml \
  's.replace("terminationGracePeriodSeconds: 30", "terminationGracePeriodSeconds: 20", 1)'
mutate "shutdown timeout raised in the ConfigMap" "--shutdown_timeout 60 s \(from env OUTBOX_SHUTDOWN_TIMEOUT\)" $B/kustomization.yaml \
  's.replace("OUTBOX_SHUTDOWN_TIMEOUT=20s", "OUTBOX_SHUTDOWN_TIMEOUT=1m", 1)'
mutate "no memory limit" "resources.limits.memory is set" $B/consumer.yaml \
  's.replace("              memory: 256Mi\n", "", 1)'
mutate "writable root file system" "readOnlyRootFilesystem is true" $B/relay.yaml \
  's.replace("readOnlyRootFilesystem: true", "readOnlyRootFilesystem: false", 1)'
mutate "privilege escalation" "allowPrivilegeEscalation is false" $B/producer.yaml \
  's.replace("allowPrivilegeEscalation: false", "allowPrivilegeEscalation: true", 1)'
mutate "capabilities kept" "capabilities drop ALL" $B/consumer.yaml \
  's.replace("drop: [\"ALL\"]", "drop: [\"NET_RAW\"]", 1)'
mutate "root user" "runAsUser is a numeric non-root uid" $B/relay.yaml \
  's.replace("runAsUser: 10001", "runAsUser: 0")'
mutate "uid differs from the image" "runAsUser 10002 equals the image.s USER 10001" $B/relay.yaml \
  's.replace("runAsUser: 10001", "runAsUser: 10002")'
mutate "no seccomp profile" "pod securityContext.seccompProfile is RuntimeDefault" $B/producer.yaml \
  's.replace("        fsGroup: 10001\n        seccompProfile:\n          type: RuntimeDefault\n", "        fsGroup: 10001\n", 1)'
mutate "service links on" "enableServiceLinks is false" $B/relay.yaml \
  's.replace("enableServiceLinks: false", "enableServiceLinks: true", 1)'
mutate "no hostname spread" "topologySpreadConstraint on kubernetes.io/hostname" $B/consumer.yaml \
  's.replace("topologyKey: kubernetes.io/hostname", "topologyKey: kubernetes.io/os", 1)'
mutate "PDB selects nothing" "exactly one PodDisruptionBudget selects its pods \(found 0\)" $B/pdb.yaml \
  's.replace("app.kubernetes.io/name: outbox-relay\n---", "app.kubernetes.io/name: outbox-relai\n---", 1)'
mutate "prod relay single replica" "outbox-relay: prod runs >= 2 replicas" deploy/k8s/overlays/prod/kustomization.yaml \
  's.replace("name: outbox-relay\n    count: 2", "name: outbox-relay\n    count: 1", 1)'
mutate "relay pointed at a missing Service" "--consumer \"outbox-billing:50053\" is a rendered Service" $B/relay.yaml \
  's.replace("--consumer=outbox-consumer:50053", "--consumer=outbox-billing:50053", 1)'
mutate "relay pointed at the wrong port" "--consumer \"outbox-consumer:9090\"" $B/relay.yaml \
  's.replace("--consumer=outbox-consumer:50053", "--consumer=outbox-consumer:9090", 1)'
mutate "consumer open to everyone" "another pod of the namespace -> outbox-consumer:50053/TCP is denied" $B/networkpolicy.yaml \
  's.replace("    - from:\n        - podSelector:\n            matchLabels:\n              app.kubernetes.io/name: outbox-relay\n", "    - from:\n        - podSelector: {}\n", 1)'
mutate "no default deny" "default-deny ingress policy" $B/networkpolicy.yaml \
  's.replace("  policyTypes:\n    - Ingress\n    - Egress\n---", "  policyTypes:\n    - Egress\n---", 1)'
mutate "relay cannot reach the consumer" "outbox-relay -> outbox-consumer:50053/TCP is allowed" $B/networkpolicy.yaml \
  's.replace("        - port: 50053\n", "        - port: 50054\n", 1)'
mutate "no DNS egress" "outbox-producer -> kube-dns:53/UDP is allowed" $B/networkpolicy.yaml \
  's.replace("values: [outbox-producer, outbox-relay, outbox-consumer, outbox-relay-audit, outbox-consumer-audit, outbox-reconcile]\n  policyTypes:\n    - Egress", "values: [outbox-relay, outbox-consumer, outbox-relay-audit, outbox-consumer-audit, outbox-reconcile]\n  policyTypes:\n    - Egress", 1)'
mutate "no DNS egress for the audit consumer" "outbox-consumer-audit -> kube-dns:53/UDP is allowed" $B/networkpolicy.yaml \
  's.replace("values: [outbox-producer, outbox-relay, outbox-consumer, outbox-relay-audit, outbox-consumer-audit, outbox-reconcile]\n  policyTypes:\n    - Egress", "values: [outbox-producer, outbox-relay, outbox-consumer, outbox-relay-audit, outbox-reconcile]\n  policyTypes:\n    - Egress", 1)'
mutate "postgres open to the namespace" "another pod of the namespace -> postgres:5432/TCP is denied" deploy/k8s/overlays/dev/networkpolicy-postgres.yaml \
  's.replace("    - from:\n        - podSelector:\n            matchExpressions:", "    - from:\n        - podSelector: {}\n        - podSelector:\n            matchExpressions:", 1)'
mutate "password in a plain env value" "OUTBOX_DB comes from a Secret" $B/consumer.yaml \
  's.replace("            - name: OUTBOX_DB\n              valueFrom:\n                secretKeyRef:\n                  name: outbox-db\n                  key: billing-url", "            - name: OUTBOX_DB\n              value: postgresql://outbox:pw@postgres:5432/outbox_billing", 1)'
mutate "consumer on the orders database" "--db names the database outbox_billing" deploy/k8s/overlays/dev/outbox-db.dev.env \
  's.replace("5432/outbox_billing", "5432/outbox_orders", 1)'
mutate "database not created" "creates the database outbox_billing" deploy/k8s/overlays/dev/postgres-init/01-create-databases.sql \
  's.replace("CREATE DATABASE outbox_billing;", "", 1)'
mutate "secret committed for prod" "renders no Secret" deploy/k8s/overlays/prod/kustomization.yaml \
  's + "secretGenerator:\n  - name: outbox-db\n    literals:\n      - orders-password=x\n"'
mutate "prod uses the dev image" "prod image comes from a registry" deploy/k8s/overlays/prod/kustomization.yaml \
  's.replace("newName: registry.example.com/outbox\n    newTag: \"0.1.0\"", "newName: outbox\n    newTag: dev", 1)'
mutate "shell-form entrypoint" "ENTRYPOINT is in exec" deploy/docker/Dockerfile \
  's.replace("ENTRYPOINT [\"/usr/local/bin/outbox-producer\"]", "ENTRYPOINT /usr/local/bin/outbox-producer", 1)'
mutate "image runs as root" "numeric non-root USER" deploy/docker/Dockerfile \
  's.replace("USER 10001:10001", "USER root", 1)'
mutate "dockerignore lets node_modules in" "excludes tests/deploy/node_modules/" .dockerignore \
  's.replace("**/node_modules\n", "", 1)'
mutate "dockerignore excludes only the top node_modules" "excludes tests/deploy/node_modules/" .dockerignore \
  's.replace("**/node_modules\n", "node_modules\n", 1)'
mutate "misspelt setting in the ConfigMap" "OUTBOX_POLL_INTERVALL \(configmap:outbox-relay-[a-z0-9]+\) is a flag of outbox-relay" $B/kustomization.yaml \
  's.replace("OUTBOX_POLL_INTERVAL=500ms", "OUTBOX_POLL_INTERVALL=500ms", 1)'
mutate "bad duration" "OUTBOX_ACK_TIMEOUT=\"15 seconds\" is a valid --ack_timeout value" $B/kustomization.yaml \
  's.replace("OUTBOX_ACK_TIMEOUT=15s", "OUTBOX_ACK_TIMEOUT=15 seconds", 1)'
mutate "unknown argument" "argument --metrics_port is a flag of outbox-consumer \(per .*/outbox-consumer --helpfull\)" $B/consumer.yaml \
  's.replace("- --metrics_listen=0.0.0.0:9090", "- --metrics_listen=0.0.0.0:9090\n            - --metrics_port=9090", 1)'
mutate "log level not among the choices" "OUTBOX_LOG_LEVEL=\"verbose\" is a valid --log_level value" $B/kustomization.yaml \
  's.replace("OUTBOX_LOG_LEVEL=info", "OUTBOX_LOG_LEVEL=verbose", 1)'
mutate "relay dialling no port" "--consumer=\"outbox-consumer\" is a valid value" $B/relay.yaml \
  's.replace("--consumer=outbox-consumer:50053", "--consumer=outbox-consumer", 1)'
mutate "unknown kind" "not a known upstream Kubernetes kind" $B/serviceaccount.yaml \
  's.replace("kind: ServiceAccount", "kind: ServiceAcount", 1)'
mutate "kustomize error" "kubectl kustomize deploy/k8s/overlays/dev failed" deploy/k8s/overlays/dev/kustomization.yaml \
  's.replace("  - postgres.yaml\n", "  - postgres-missing.yaml\n", 1)'

# Mutual TLS and its certificates.
C=deploy/k8s/components/selfsigned-ca
mutate "missing Certificate" "outbox-consumer TLS: outbox-consumer: --tls_cert: Secret outbox-consumer-tls is issued by a Certificate" $B/tls.yaml \
  '"---".join(p for p in s.split("---") if "\n  name: outbox-consumer\n" not in p)'
mutate "wrong SPIFFE id" "URI SAN is exactly spiffe://outbox/relay \(found spiffe://outbox/relai\)" $B/tls.yaml \
  's.replace("    - spiffe://outbox/relay\n", "    - spiffe://outbox/relai\n", 1)'
mutate "plaintext relay -> consumer" "outbox-relay: --consumer_ca is set" $B/relay.yaml \
  's.replace("            - --consumer_ca=/etc/outbox/tls/ca.crt\n            - --client_cert=/etc/outbox/tls/tls.crt\n            - --client_key=/etc/outbox/tls/tls.key\n", "", 1)'
mutate "TLS off on the producer" "outbox-producer: --tls_cert is set \(mutual TLS on by default\)" $B/producer.yaml \
  's.replace("            - --tls_cert=/etc/outbox/tls/tls.crt\n            - --tls_key=/etc/outbox/tls/tls.key\n            - --tls_client_ca=/etc/outbox/tls/ca.crt\n", "", 1)'
mutate "server TLS without client certificates" "outbox-consumer: --tls_client_ca is set" $B/consumer.yaml \
  's.replace("            - --tls_client_ca=/etc/outbox/tls/ca.crt\n", "", 1)'
mutate "consumer admits every client of the CA" "--allowed_clients is set \(empty would admit every certificate of the CA" $B/consumer.yaml \
  's.replace("            - --allowed_clients=spiffe://outbox/relay,spiffe://outbox/outboxctl\n", "", 1)'
mutate "consumer does not admit the relay" "--allowed_clients admits the relay" $B/consumer.yaml \
  's.replace("--allowed_clients=spiffe://outbox/relay,spiffe://outbox/outboxctl", "--allowed_clients=spiffe://outbox/outboxctl", 1)'
mutate "admitted identity with a typo" "spiffe://outbox/realy is the URI SAN of a Certificate" $B/consumer.yaml \
  's.replace("--allowed_clients=spiffe://outbox/relay,", "--allowed_clients=spiffe://outbox/relay,spiffe://outbox/realy,", 1)'
mutate "relay without --admin_clients" "--admin_clients is set" $B/relay.yaml \
  's.replace("            - --admin_clients=spiffe://outbox/outboxctl\n", "", 1)'
mutate "writable certificate mount" "--tls_cert: the volumeMount /etc/outbox/tls is readOnly" $B/consumer.yaml \
  's.replace("              mountPath: /etc/outbox/tls\n              readOnly: true\n", "              mountPath: /etc/outbox/tls\n              readOnly: false\n", 1)'
mutate "certificate read through subPath" "no subPath \(the kubelet never updates a subPath mount" $B/relay.yaml \
  's.replace("              mountPath: /etc/outbox/tls\n", "              mountPath: /etc/outbox/tls\n              subPath: certs\n", 1)'
mutate "key from the wrong Secret key" "--tls_key: reads the key tls.key of Secret outbox-producer-tls \(reads tls.crt\)" $B/producer.yaml \
  's.replace("--tls_key=/etc/outbox/tls/tls.key", "--tls_key=/etc/outbox/tls/tls.crt", 1)'
mutate "relay dials a name the consumer certificate lacks" "the relay.s --consumer host \"outbox-consumer\" is among the dnsNames of Certificate outbox-consumer" $B/tls.yaml \
  's.replace("    - outbox-consumer\n", "", 1)'
mutate "namespace left out of the DNS names" "dnsNames include outbox-consumer.outbox.svc " deploy/k8s/overlays/prod/kustomization.yaml \
  's.replace("      - select:\n          kind: Certificate\n          name: outbox-consumer\n        fieldPaths: *dns\n        options: *second-label\n", "", 1)'
mutate "key kept at renewal" "privateKey.rotationPolicy is Always" $B/tls.yaml \
  's.replace("rotationPolicy: Always", "rotationPolicy: Never", 1)'
mutate "relay certificate without client auth" "the relay.s client certificate\): usages include \"client auth\"" $B/tls.yaml \
  's.replace("  # consumer presents this certificate too.\n  usages:\n    - server auth\n    - client auth\n", "  # consumer presents this certificate too.\n  usages:\n    - server auth\n", 1)'
mutate "misspelt Certificate field" "spec.privateKey.rotationPolcy: unknown field \(not in Certificate.spec.privateKey\)" $B/tls.yaml \
  's.replace("    rotationPolicy: Always\n", "    rotationPolcy: Always\n", 1)'
mutate "invalid key usage" "usages/0: must be equal to one of the allowed values" $B/tls.yaml \
  's.replace("    - server auth\n", "    - server-auth\n", 1)'
mutate "CA Issuer missing" "its issuerRef names an Issuer rendered in the namespace \(found cert-manager.io/Issuer/outbox-ca\)" $C/ca.yaml \
  's.replace("  name: outbox-ca\n  labels:\n    app.kubernetes.io/part-of: outbox\n    app.kubernetes.io/component: ca\nspec:\n  ca:", "  name: outbox-root\n  labels:\n    app.kubernetes.io/part-of: outbox\n    app.kubernetes.io/component: ca\nspec:\n  ca:", 1)'
mutate "outboxctl from another issuer" "every service and outboxctl certificate comes from one issuer" $B/tls.yaml \
  's.replace("    name: outbox-ca\n  commonName: outboxctl\n", "    name: outbox-selfsigned\n  commonName: outboxctl\n", 1)'
mutate "CA issuer backed by a non-CA certificate" "Issuer outbox-ca: its Secret outbox-ca comes from Certificate outbox-ca with isCA: true" $C/ca.yaml \
  's.replace("  isCA: true\n", "", 1)'

# Fan-out: the second subscription, audit (relay-audit.yaml,
# consumer-audit.yaml). Each subscription needs its own relay, delivering to
# a consumer of its handler, on a database of its own, and only there.
mutate "audit relay pointed at the billing consumer" "outbox-relay-audit \(subscription audit\) delivers to a consumer with --handler=audit \(outbox-consumer runs billing\)" $B/relay-audit.yaml \
  's.replace("--consumer=outbox-consumer-audit:50053", "--consumer=outbox-consumer:50053", 1)'
mutate "audit relay delivering billing" "exactly one relay Deployment delivers the subscription audit \(found none\)" $B/relay-audit.yaml \
  's.replace("            - --subscription=audit\n", "", 1)'
mutate "unknown subscription" "outbox-relay-audit: --subscription \"audits\" is one of billing, audit" $B/relay-audit.yaml \
  's.replace("            - --subscription=audit\n", "            - --subscription=audits\n", 1)'
mutate "audit consumer running the billing handler" "delivers to a consumer with --handler=audit \(outbox-consumer-audit runs billing\)" $B/consumer-audit.yaml \
  's.replace("            - --handler=audit\n", "", 1)'
mutate "audit consumer on the billing database" "--db names the database outbox_audit" deploy/k8s/overlays/dev/outbox-db.dev.env \
  's.replace("5432/outbox_audit", "5432/outbox_billing", 1)'
mutate "audit consumer reads the billing Secret key" "outbox-consumer and outbox-consumer-audit take their database from different places \(both: secret outbox-db key billing-url\)" $B/consumer-audit.yaml \
  's.replace("key: audit-url", "key: billing-url", 1)'
mutate "audit database not created" "creates the database outbox_audit" deploy/k8s/overlays/dev/postgres-init/01-create-databases.sql \
  's.replace("CREATE DATABASE outbox_audit;", "", 1)'
mutate "audit relay cannot reach its consumer" "outbox-relay-audit -> outbox-consumer-audit:50053/TCP is allowed" $B/networkpolicy.yaml \
  's.replace("              app.kubernetes.io/name: outbox-consumer-audit\n      ports:\n        - port: 50053\n", "              app.kubernetes.io/name: outbox-consumer\n      ports:\n        - port: 50053\n", 1)'
mutate "billing relay may deliver into the audit consumer" "outbox-relay -> outbox-consumer-audit:50053/TCP is denied" $B/networkpolicy.yaml \
  's.replace("            matchLabels:\n              app.kubernetes.io/name: outbox-relay-audit\n      ports:\n        - port: grpc\n", "            matchLabels:\n              app.kubernetes.io/component: relay\n      ports:\n        - port: grpc\n", 1).replace("  name: outbox-relay-egress\nspec:\n  podSelector:\n    matchLabels:\n      app.kubernetes.io/name: outbox-relay\n  policyTypes:\n    - Egress\n  egress:\n    - to:\n        - podSelector:\n            matchLabels:\n              app.kubernetes.io/name: outbox-consumer\n", "  name: outbox-relay-egress\nspec:\n  podSelector:\n    matchLabels:\n      app.kubernetes.io/name: outbox-relay\n  policyTypes:\n    - Egress\n  egress:\n    - to:\n        - podSelector:\n            matchLabels:\n              app.kubernetes.io/component: consumer\n", 1)'
mutate "audit consumer left out of the PostgreSQL policy" "outbox-consumer-audit -> postgres:5432/TCP is allowed" deploy/k8s/overlays/dev/networkpolicy-postgres.yaml \
  's.replace(", outbox-consumer-audit, outbox-reconcile]", ", outbox-reconcile]", 1)'
mutate "audit consumer without a budget" "outbox-consumer-audit: exactly one PodDisruptionBudget selects its pods \(found 0\)" $B/pdb.yaml \
  's.replace("      app.kubernetes.io/name: outbox-consumer-audit\n", "      app.kubernetes.io/name: outbox-consumer-audti\n", 1)'
mutate "prod audit relay single replica" "outbox-relay-audit: prod runs >= 2 replicas" deploy/k8s/overlays/prod/kustomization.yaml \
  's.replace("name: outbox-relay-audit\n    count: 2", "name: outbox-relay-audit\n    count: 1", 1)'
mutate "audit relay with an identity the consumers do not admit" "URI SAN is exactly spiffe://outbox/relay \(found spiffe://outbox/relay-audit\)" $B/tls.yaml \
  's.replace("  commonName: outbox-relay-audit\n  uris:\n    - spiffe://outbox/relay\n", "  commonName: outbox-relay-audit\n  uris:\n    - spiffe://outbox/relay-audit\n", 1)'
mutate "audit consumer certificate lacks the name the relay dials" "the relay.s --consumer host \"outbox-consumer-audit\" is among the dnsNames of Certificate outbox-consumer-audit" $B/tls.yaml \
  's.replace("    - outbox-consumer-audit\n", "", 1)'
mutate "audit consumer serves the billing consumer's certificate" "Certificate outbox-consumer: DNS name outbox-consumer names a Service of outbox-consumer-audit" $B/consumer-audit.yaml \
  's.replace("secretName: outbox-consumer-audit-tls", "secretName: outbox-consumer-tls", 1)'
mutate "audit namespace left out of the DNS names" "dnsNames include outbox-consumer-audit.outbox.svc " deploy/k8s/overlays/prod/kustomization.yaml \
  's.replace("      - select:\n          kind: Certificate\n          name: outbox-consumer-audit\n        fieldPaths: *dns\n        options: *second-label\n", "", 1)'

# Monitoring (components/monitoring, in prod): the prometheus-operator
# objects validate strictly, the PodMonitor scrapes every Deployment's
# metrics port with job = its name, the dashboard ConfigMap holds JSON.
M=deploy/k8s/components/monitoring
mutate "misspelt PrometheusRule field" "spec.groups\[0\].rules\[0\].anotations: unknown field" deploy/monitoring/prometheus-rule.yaml \
  's.replace("          annotations:", "          anotations:", 1)'
mutate "PodMonitor on the gRPC port" "podMetricsEndpoints port \"grpc\" is outbox-relay.s port \"metrics\"" $M/podmonitor.yaml \
  's.replace("- port: metrics", "- port: grpc", 1)'
mutate "PodMonitor without the job label" "jobLabel \(unset\) gives outbox-consumer-audit.s series job=\"outbox-consumer-audit\"" $M/podmonitor.yaml \
  's.replace("  jobLabel: app.kubernetes.io/name\n", "", 1)'
mutate "dashboard that is not JSON" "outbox.json is JSON" deploy/monitoring/dashboard.json \
  's.replace("{", "", 1)'

# The reconcile CronJob (reconcile.yaml): enabled, on a schedule that
# compares each event twice within its window, one run at a time and no
# retry, hardened like the services, outboxctl's own flags, the services'
# Secret keys, and admitted to PostgreSQL only.
R=$B/reconcile.yaml
mutate "reconcile suspended in the base" "base: CronJob/outbox-reconcile: suspend is false" $R \
  's.replace("suspend: false", "suspend: true", 1)'
mutate "reconcile suspended by the prod overlay" "prod CronJob/outbox-reconcile: suspend is false" deploy/k8s/overlays/prod/kustomization.yaml \
  's + "\npatches:\n  - target:\n      kind: CronJob\n      name: outbox-reconcile\n    patch: |-\n      - op: replace\n        path: /spec/suspend\n        value: true\n" if "\npatches:" not in s else s.replace("\npatches:\n", "\npatches:\n  - target:\n      kind: CronJob\n      name: outbox-reconcile\n    patch: |-\n      - op: replace\n        path: /spec/suspend\n        value: true\n", 1)'
mutate "reconcile too seldom for its window" "covers two runs of schedule \"4 \* \* \* \*\"" $R \
  's.replace("schedule: \"4-59/15 * * * *\"", "schedule: \"4 * * * *\"", 1)'
mutate "reconcile on a schedule the check cannot read" "schedule \"4 3 \* \* \*\" is minutes of every hour" $R \
  's.replace("schedule: \"4-59/15 * * * *\"", "schedule: \"4 3 * * *\"", 1)'
mutate "reconcile with an unknown flag" "argument --windw is a flag of outboxctl \(per .*outboxctl --helpfull\)" $R \
  's.replace("- --window=1h", "- --windw=1h", 1)'
mutate "reconcile with a bad duration" "--grace=\"soon\" is a valid value" $R \
  's.replace("- --grace=5m", "- --grace=soon", 1)'
mutate "reconcile without runAsNonRoot" "CronJob/outbox-reconcile: pod securityContext.runAsNonRoot is true" $R \
  's.replace("runAsNonRoot: true", "runAsNonRoot: false", 2)'
mutate "reconcile with a writable root" "CronJob/outbox-reconcile: container reconcile: readOnlyRootFilesystem is true" $R \
  's.replace("readOnlyRootFilesystem: true", "readOnlyRootFilesystem: false", 1)'
mutate "reconcile retried" "CronJob/outbox-reconcile: jobTemplate backoffLimit is 0" $R \
  's.replace("backoffLimit: 0", "backoffLimit: 3", 1)'
mutate "reconcile runs concurrently" "CronJob/outbox-reconcile: concurrencyPolicy is Forbid" $R \
  's.replace("concurrencyPolicy: Forbid", "concurrencyPolicy: Allow", 1)'
mutate "reconcile reads another database" "OUTBOX_BILLING_DB is Secret outbox-db key audit-url, the one outbox-consumer reads" $R \
  's.replace("key: billing-url", "key: audit-url", 1)'
mutate "reconcile with the orders password for billing" "OUTBOX_BILLING_PASSWORD is the Secret key outbox-db/billing-password that outbox-consumer passes as PGPASSWORD" $R \
  's.replace("key: billing-password", "key: orders-password", 1)'
mutate "reconcile with one PGPASSWORD" "container reconcile: no PGPASSWORD" $R \
  's.replace("- name: OUTBOX_ORDERS_PASSWORD", "- name: PGPASSWORD\n                  value: x\n                - name: OUTBOX_ORDERS_PASSWORD", 1)'
mutate "reconcile not admitted by PostgreSQL" "dev NetworkPolicy: outbox-reconcile -> postgres:5432/TCP is allowed" deploy/k8s/overlays/dev/networkpolicy-postgres.yaml \
  's.replace(", outbox-reconcile]", "]", 1)'
mutate "reconcile without egress to the external PostgreSQL" "prod NetworkPolicy: outbox-reconcile -> an external PostgreSQL:5432/TCP is allowed" deploy/k8s/overlays/prod/networkpolicy-postgres.yaml \
  's.replace(", outbox-reconcile]", "]", 1)'
mutate "reconcile without DNS" "outbox-reconcile -> kube-dns:53/UDP is allowed" $B/networkpolicy.yaml \
  's.replace(", outbox-reconcile]", "]", 1)'

# JetStream mode (components/jetstream, in overlays/prod-jetstream): the
# connection's flags are the binaries', credentials only from Secrets,
# TLS from read-only Secret mounts, each relay paired by stream with its
# consumer, and the NetworkPolicies open the NATS client port to exactly
# the relays and consumers.
J=deploy/k8s/components/jetstream
mutate "JetStream password as a literal argument" "container relay: --jetstream_password is not a literal argument" $J/relay.yaml \
  's + "- op: add\n  path: /spec/template/spec/containers/0/args/-\n  value: --jetstream_password=hunter2\n"'
mutate "JetStream password as a literal variable" "container relay: OUTBOX_JETSTREAM_PASSWORD comes from a Secret" $J/streams.yaml \
  's.replace("            - name: OUTBOX_JETSTREAM_SUBJECTS\n              value: outbox.billing\n", "            - name: OUTBOX_JETSTREAM_SUBJECTS\n              value: outbox.billing\n            - name: OUTBOX_JETSTREAM_PASSWORD\n              value: hunter2\n", 1)'
mutate "JetStream token in a ConfigMap" "OUTBOX_JETSTREAM_TOKEN comes from a Secret \(found configmap:outbox-jetstream-" $J/kustomization.yaml \
  's.replace("      - OUTBOX_JETSTREAM_CREDS=", "      - OUTBOX_JETSTREAM_TOKEN=s3cr3t\n      - OUTBOX_JETSTREAM_CREDS=", 1)'
mutate "two kinds of NATS credentials" "exactly one kind of NATS credentials: .*\(found --jetstream_creds, --jetstream_user\)" $J/kustomization.yaml \
  's.replace("      - OUTBOX_JETSTREAM_CREDS=", "      - OUTBOX_JETSTREAM_USER=outbox\n      - OUTBOX_JETSTREAM_CREDS=", 1)'
mutate "misspelt JetStream setting" "OUTBOX_JETSTREAM_REPLICA \(configmap:outbox-jetstream-relay-[a-z0-9]+\) is a flag of outbox-relay" $J/kustomization.yaml \
  's.replace("OUTBOX_JETSTREAM_REPLICAS=3", "OUTBOX_JETSTREAM_REPLICA=3", 1)'
mutate "misspelt JetStream variable" "OUTBOX_JETSTREAM_DURABEL \(literal\) is a flag of outbox-consumer" $J/streams.yaml \
  's.replace("OUTBOX_JETSTREAM_DURABLE", "OUTBOX_JETSTREAM_DURABEL", 1)'
mutate "misspelt JetStream argument" "argument --jetstream_stram is a flag of outbox-relay" $J/relay.yaml \
  's + "- op: add\n  path: /spec/template/spec/containers/0/args/-\n  value: --jetstream_stram=OUTBOX_BILLING\n"'
mutate "relay-only JetStream setting given to the consumers" "OUTBOX_JETSTREAM_DUPLICATE_WINDOW \(configmap:outbox-jetstream-[a-z0-9]+\) is a flag of outbox-consumer" $J/kustomization.yaml \
  's.replace("      - OUTBOX_JETSTREAM_CREDS=", "      - OUTBOX_JETSTREAM_DUPLICATE_WINDOW=5m\n      - OUTBOX_JETSTREAM_CREDS=", 1)'
mutate "JetStream duration that does not parse" "OUTBOX_JETSTREAM_ACK_WAIT=\"30 seconds\" is a valid --jetstream_ack_wait value" $J/kustomization.yaml \
  's.replace("OUTBOX_JETSTREAM_ACK_WAIT=30s", "OUTBOX_JETSTREAM_ACK_WAIT=30 seconds", 1)'
mutate "plaintext to NATS" "--jetstream: \"nats://nats.nats.svc:4222\" is tls://" $J/kustomization.yaml \
  's.replace("OUTBOX_JETSTREAM=tls://", "OUTBOX_JETSTREAM=nats://", 1)'
mutate "NATS URL with a password" "--jetstream: \"tls://outbox:pw@nats.nats.svc:4222\" carries no credentials" $J/kustomization.yaml \
  's.replace("OUTBOX_JETSTREAM=tls://", "OUTBOX_JETSTREAM=tls://outbox:pw@", 1)'
mutate "no CA for NATS" "outbox-relay JetStream: --jetstream_ca is set" $J/kustomization.yaml \
  's.replace("      - OUTBOX_JETSTREAM_CA=/etc/outbox/nats/tls/ca.crt\n", "", 1)'
mutate "NATS client key from the wrong Secret key" "--jetstream_key: reads the key tls.key of Secret outbox-nats-relay-tls \(reads tls.crt\)" $J/kustomization.yaml \
  's.replace("OUTBOX_JETSTREAM_KEY=/etc/outbox/nats/tls/tls.key", "OUTBOX_JETSTREAM_KEY=/etc/outbox/nats/tls/tls.crt", 1)'
mutate "NATS client certificate without client auth" "Certificate outbox-nats-relay \(NATS client\): usages include \"client auth\"" $J/certificate.yaml \
  's.replace("    - client auth\n", "", 1)'
mutate "NATS credentials mounted writable" "--jetstream_creds: the volumeMount /etc/outbox/nats/creds is readOnly" $J/relay.yaml \
  's.replace("    mountPath: /etc/outbox/nats/creds\n    readOnly: true\n", "    mountPath: /etc/outbox/nats/creds\n    readOnly: false\n", 1)'
mutate "NATS credentials through subPath" "--jetstream_creds: the volumeMount /etc/outbox/nats/creds has no subPath" $J/consumer.yaml \
  's.replace("    mountPath: /etc/outbox/nats/creds\n", "    mountPath: /etc/outbox/nats/creds\n    subPath: nats\n", 1)'
mutate "NATS credentials optional" "--jetstream_creds: the Secret volume is not optional" $J/relay.yaml \
  's.replace("      secretName: outbox-nats\n", "      secretName: outbox-nats\n      optional: true\n", 1)'
mutate "consumer durable with a dot" "--jetstream_durable \"outbox.consumer\" is non-empty, without" $J/streams.yaml \
  's.replace("value: outbox-consumer\n", "value: outbox.consumer\n", 1)'
mutate "audit relay publishing to a stream nobody reads" "outbox-relay-audit JetStream: exactly one JetStream consumer Deployment reads its stream OUTBOX_AUDITS \(found none\)" $J/streams.yaml \
  's.replace("value: OUTBOX_AUDIT\n", "value: OUTBOX_AUDITS\n", 1)'
mutate "audit consumer on another subject prefix" "outbox-consumer-audit reads the subjects outbox.audit.> it publishes \(its prefix: outbox.audits\)" $J/streams.yaml \
  's.replace("value: outbox.audit\n            - name: OUTBOX_JETSTREAM_DURABLE", "value: outbox.audits\n            - name: OUTBOX_JETSTREAM_DURABLE", 1)'
mutate "both subscriptions on one stream" "outbox-relay and outbox-relay-audit \(subscriptions billing, audit\) publish to streams of their own \(both: OUTBOX_BILLING\)" $J/streams.yaml \
  's.replace("value: OUTBOX_AUDIT\n", "value: OUTBOX_BILLING\n").replace("value: outbox.audit\n", "value: outbox.billing.audit\n")'
mutate "single-replica stream in prod" "prod: --jetstream_replicas 1 >= 3" $J/kustomization.yaml \
  's.replace("OUTBOX_JETSTREAM_REPLICAS=3", "OUTBOX_JETSTREAM_REPLICAS=1", 1)'
mutate "no egress to NATS" "outbox-consumer-audit -> NATS nats.nats.svc .*:4222/TCP is allowed" $J/networkpolicy.yaml \
  's.replace("        - port: 4222\n", "        - port: 4223\n", 1)'
mutate "egress to NATS of another namespace" "outbox-relay -> NATS nats.nats.svc \(the servers. pods in namespace nats\):4222/TCP is allowed" $J/networkpolicy.yaml \
  's.replace("kubernetes.io/metadata.name: nats\n", "kubernetes.io/metadata.name: nats-system\n", 1)'
mutate "egress to NATS-like pods of any namespace" "outbox-relay -> a pod labelled like NATS in another namespace:4222/TCP is denied" $J/networkpolicy.yaml \
  's.replace("        - namespaceSelector:\n            matchLabels:\n              kubernetes.io/metadata.name: nats\n          podSelector:", "        - namespaceSelector: {}\n          podSelector:", 1)'
mutate "egress on 4222 to every address" "outbox-relay -> an arbitrary external address:4222/TCP is denied" $J/networkpolicy.yaml \
  's.replace("    - to:\n        - namespaceSelector:\n            matchLabels:\n              kubernetes.io/metadata.name: nats\n          podSelector:\n            matchLabels:\n              app.kubernetes.io/name: nats\n      ports:", "    - ports:", 1)'
mutate "egress to every NATS port" "outbox-consumer -> NATS nats.nats.svc .*:6222/TCP is denied" $J/networkpolicy.yaml \
  's.replace("      ports:\n        - port: 4222\n          protocol: TCP\n", "", 1)'
mutate "producer may reach NATS" "outbox-producer -> NATS nats.nats.svc .*:4222/TCP is denied" $J/networkpolicy.yaml \
  's.replace("values: [outbox-relay,", "values: [outbox-producer, outbox-relay,", 1)'
mutate "JetStream overlay without the component" "prod-jetstream outbox-relay JetStream: runs in JetStream mode" deploy/k8s/overlays/prod-jetstream/kustomization.yaml \
  's.replace("components:\n  - ../../components/jetstream\n", "", 1)'
mutate "NATS credentials committed for prod" "prod-jetstream: renders no Secret" deploy/k8s/overlays/prod-jetstream/kustomization.yaml \
  's + "secretGenerator:\n  - name: outbox-nats\n    literals:\n      - relay.creds=x\n      - consumer.creds=x\n"'
fresh
rm -rf "$tmp/t/deploy/k8s/overlays/prod-jetstream"
out=$("$tmp/t/tests/deploy/validate.sh" "$bin_dir" 2>&1) && rc=0 || rc=$?
if [[ $rc -ne 0 ]] && grep -q -- "prod-jetstream" <<<"$out"; then
  passed=$((passed + 1)); echo "ok   the JetStream overlay is required"
else
  failed=$((failed + 1)); echo "FAIL without overlays/prod-jetstream: validate.sh exited $rc; output:"
  tail -n 15 <<<"$out" | sed 's/^/     /'
fi

# The documented alternatives (deploy/README.md, "JetStream mode") pass:
# user and password through secretKeyRef instead of the .creds file, and
# a CA Secret of one's own instead of cert-manager's client certificates.
# variant NAME OVERLAY-KUSTOMIZATION-TEXT: an extra overlay on
# prod-jetstream that validate.sh must accept.
variant() {
  local name=$1 text=$2 dir out rc=0
  fresh
  dir="$tmp/t/deploy/k8s/overlays/prod-jetstream-variant"
  mkdir -p "$dir"
  printf '%s\n' "$text" >"$dir/kustomization.yaml"
  out=$("$tmp/t/tests/deploy/validate.sh" "$bin_dir" 2>&1) || rc=$?
  if [[ $rc -eq 0 ]] && grep -q "prod-jetstream-variant: .* 0 failed" <<<"$out"; then
    passed=$((passed + 1)); echo "ok   $name"
  else
    failed=$((failed + 1)); echo "FAIL $name: validate.sh exited $rc; output:"
    grep '^FAIL' <<<"$out" | head -n 15 | sed 's/^/     /'
  fi
}
variant "JetStream with user and password from a Secret" 'apiVersion: kustomize.config.k8s.io/v1beta1
kind: Kustomization
resources:
  - ../prod-jetstream
configMapGenerator:
  - name: outbox-jetstream
    behavior: merge
    literals:
      - OUTBOX_JETSTREAM_CREDS=
patches:
  - target:
      kind: Deployment
      labelSelector: app.kubernetes.io/component=relay
    patch: |-
      apiVersion: apps/v1
      kind: Deployment
      metadata:
        name: relays
      spec:
        template:
          spec:
            containers:
              - name: relay
                env:
                  - name: OUTBOX_JETSTREAM_USER
                    valueFrom: {secretKeyRef: {name: outbox-nats, key: relay-user}}
                  - name: OUTBOX_JETSTREAM_PASSWORD
                    valueFrom: {secretKeyRef: {name: outbox-nats, key: relay-password}}
                volumeMounts:
                  - {mountPath: /etc/outbox/nats/creds, $patch: delete}
            volumes:
              - {name: nats-creds, $patch: delete}
  - target:
      kind: Deployment
      labelSelector: app.kubernetes.io/component=consumer
    patch: |-
      apiVersion: apps/v1
      kind: Deployment
      metadata:
        name: consumers
      spec:
        template:
          spec:
            containers:
              - name: consumer
                env:
                  - name: OUTBOX_JETSTREAM_USER
                    valueFrom: {secretKeyRef: {name: outbox-nats, key: consumer-user}}
                  - name: OUTBOX_JETSTREAM_PASSWORD
                    valueFrom: {secretKeyRef: {name: outbox-nats, key: consumer-password}}
                volumeMounts:
                  - {mountPath: /etc/outbox/nats/creds, $patch: delete}
            volumes:
              - {name: nats-creds, $patch: delete}'
variant "JetStream with a CA Secret of its own" 'apiVersion: kustomize.config.k8s.io/v1beta1
kind: Kustomization
resources:
  - ../prod-jetstream
configMapGenerator:
  - name: outbox-jetstream
    behavior: merge
    literals:
      - OUTBOX_JETSTREAM_CERT=
      - OUTBOX_JETSTREAM_KEY=
patches:
  - target:
      kind: Deployment
      labelSelector: app.kubernetes.io/component in (relay,consumer)
    patch: |-
      apiVersion: apps/v1
      kind: Deployment
      metadata:
        name: relays-and-consumers
      spec:
        template:
          spec:
            volumes:
              - name: nats-tls
                secret:
                  secretName: outbox-nats-ca
  - patch: |-
      $patch: delete
      apiVersion: cert-manager.io/v1
      kind: Certificate
      metadata:
        name: outbox-nats-relay
  - patch: |-
      $patch: delete
      apiVersion: cert-manager.io/v1
      kind: Certificate
      metadata:
        name: outbox-nats-consumer'

# The binaries' --helpfull decides which flags exist: fake binaries that
# know only --listen must make every other flag in the manifests fail.
fresh
mkdir -p "$tmp/fakebin"
for b in outbox-producer outbox-relay outbox-consumer outboxctl; do
  cat >"$tmp/fakebin/$b" <<'EOF'
#!/bin/sh
echo "fake: a binary that knows one flag"
echo "  Flags from fake.cc:"
echo '    --listen (gRPC listen address.); default: "127.0.0.1:50051";'
exit 1
EOF
  chmod +x "$tmp/fakebin/$b"
done
out=$("$tmp/t/tests/deploy/validate.sh" "$tmp/fakebin" 2>&1) && rc=0 || rc=$?
if [[ $rc -ne 0 ]] && grep -qF -- "argument --health_listen is a flag of outbox-producer (per $tmp/fakebin/outbox-producer --helpfull)" <<<"$out" &&
  grep -qF -- "argument --window is a flag of outboxctl (per $tmp/fakebin/outboxctl --helpfull)" <<<"$out" &&
  ! grep -qF -- "argument --listen is a flag" <<<"$out"; then
  passed=$((passed + 1)); echo "ok   flags come from the binaries' --helpfull"
else
  failed=$((failed + 1)); echo "FAIL flags from --helpfull: validate.sh exited $rc; output:"
  tail -n 15 <<<"$out" | sed 's/^/     /'
fi

# Without the binaries validate.sh fails, naming what is missing, rather
# than checking the flags against anything else.
fresh
mkdir -p "$tmp/nobin"
cp "$tmp/fakebin/outbox-producer" "$tmp/fakebin/outbox-relay" "$tmp/nobin/"
out=$("$tmp/t/tests/deploy/validate.sh" "$tmp/nobin" 2>&1) && rc=0 || rc=$?
if [[ $rc -ne 0 ]] && grep -qF -- "$tmp/nobin/outbox-consumer is missing" <<<"$out"; then
  passed=$((passed + 1)); echo "ok   a missing binary is an error"
else
  failed=$((failed + 1)); echo "FAIL a missing binary: validate.sh exited $rc; output:"
  tail -n 15 <<<"$out" | sed 's/^/     /'
fi
out=$(env -u OUTBOX_DEPLOY_BIN "$tmp/t/tests/deploy/validate.sh" 2>&1) && rc=0 || rc=$?
if [[ $rc -ne 0 ]] && grep -qF -- "BIN_DIR $tmp/t/build/bin is not a directory" <<<"$out"; then
  passed=$((passed + 1)); echo "ok   no BIN_DIR and no build/bin is an error"
else
  failed=$((failed + 1)); echo "FAIL no binaries: validate.sh exited $rc; output:"
  tail -n 15 <<<"$out" | sed 's/^/     /'
fi

mutation_verdicts
echo "validate self-test: $passed passed, $failed failed"
[[ $failed -eq 0 ]]
