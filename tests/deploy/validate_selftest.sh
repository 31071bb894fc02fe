#!/usr/bin/env bash
# Proves that tests/deploy/validate.sh catches the mistakes it is meant to:
# copies deploy/, .dockerignore and the checks into a scratch tree, breaks
# one thing at a time and expects validate.sh to fail naming the problem.
#
# Usage: tests/deploy/validate_selftest.sh   (from any directory; exit 0/1)
set -euo pipefail

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
root=$(cd "$here/../.." && pwd)
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT

fresh() {
  rm -rf "$tmp/t"
  mkdir -p "$tmp/t/tests"
  cp -r "$root/deploy" "$tmp/t/deploy"
  cp -r "$root/tests/deploy" "$tmp/t/tests/deploy"
  cp "$root/.dockerignore" "$tmp/t/.dockerignore"
  ln -s "$root/node_modules" "$tmp/t/node_modules"
}

passed=0
failed=0
# mutate NAME EXPECTED-OUTPUT-REGEX FILE PYTHON-EXPRESSION-ON-s
mutate() {
  local name=$1 expect=$2 file=$3 expr=$4
  fresh
  python3 - "$tmp/t/$file" "$expr" <<'PY'
import sys
path, expr = sys.argv[1], sys.argv[2]
s = open(path).read()
new = eval(expr, {"s": s})
if new == s:
    sys.exit("mutation changed nothing")
open(path, "w").write(new)
PY
  local out rc=0
  out=$("$tmp/t/tests/deploy/validate.sh" 2>&1) || rc=$?
  if [[ $rc -ne 0 ]] && grep -Eq -- "$expect" <<<"$out"; then
    passed=$((passed + 1))
    echo "ok   $name"
  else
    failed=$((failed + 1))
    echo "FAIL $name: validate.sh exited $rc; expected a failure matching /$expect/; output:"
    tail -n 15 <<<"$out" | sed 's/^/     /'
  fi
}

# The unmodified tree passes.
fresh
if "$tmp/t/tests/deploy/validate.sh" >/dev/null 2>&1; then
  passed=$((passed + 1)); echo "ok   unmodified tree passes"
else
  failed=$((failed + 1)); echo "FAIL unmodified tree does not pass"
fi

B=deploy/k8s/base
mutate "misspelt field" "readinesProbe: unknown field" $B/producer.yaml \
  's.replace("readinessProbe:", "readinesProbe:", 1)'
mutate "probe on a wrong port" "readinessProbe.grpc.port 50052 equals the --listen port 50051" $B/producer.yaml \
  's.replace("readinessProbe:\n            grpc:\n              port: 50051", "readinessProbe:\n            grpc:\n              port: 50052", 1)'
mutate "http probe instead of grpc" "livenessProbe is a grpc probe" $B/consumer.yaml \
  's.replace("livenessProbe:\n            grpc:\n              port: 50053", "livenessProbe:\n            tcpSocket:\n              port: 50053", 1)'
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
  's.replace("      securityContext:\n        runAsNonRoot: true\n        runAsUser: 10001\n        runAsGroup: 10001\n        seccompProfile:\n          type: RuntimeDefault\n", "      securityContext:\n        runAsNonRoot: true\n        runAsUser: 10001\n        runAsGroup: 10001\n", 1)'
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
  's.replace("values: [outbox-producer, outbox-relay, outbox-consumer]\n  policyTypes:\n    - Egress", "values: [outbox-relay, outbox-consumer]\n  policyTypes:\n    - Egress", 1)'
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
mutate "dockerignore lets node_modules in" "excludes node_modules" .dockerignore \
  's.replace("node_modules\n", "", 1)'
mutate "misspelt setting in the ConfigMap" "OUTBOX_POLL_INTERVALL \(configmap:outbox-relay-[a-z0-9]+\) is a flag of outbox-relay" $B/kustomization.yaml \
  's.replace("OUTBOX_POLL_INTERVAL=500ms", "OUTBOX_POLL_INTERVALL=500ms", 1)'
mutate "bad duration" "OUTBOX_ACK_TIMEOUT=\"15 seconds\" is a valid --ack_timeout value" $B/kustomization.yaml \
  's.replace("OUTBOX_ACK_TIMEOUT=15s", "OUTBOX_ACK_TIMEOUT=15 seconds", 1)'
mutate "unknown argument" "argument --metrics_port is a flag of outbox-consumer" $B/consumer.yaml \
  's.replace("- --metrics_listen=0.0.0.0:9090", "- --metrics_listen=0.0.0.0:9090\n            - --metrics_port=9090", 1)'
mutate "unknown kind" "not a known upstream Kubernetes kind" $B/serviceaccount.yaml \
  's.replace("kind: ServiceAccount", "kind: ServiceAcount", 1)'
mutate "kustomize error" "kubectl kustomize deploy/k8s/overlays/dev failed" deploy/k8s/overlays/dev/kustomization.yaml \
  's.replace("  - postgres.yaml\n", "  - postgres-missing.yaml\n", 1)'

echo "validate self-test: $passed passed, $failed failed"
[[ $failed -eq 0 ]]
