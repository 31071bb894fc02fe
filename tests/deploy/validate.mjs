#!/usr/bin/env node
// Validates rendered kustomize overlays offline.
//
//   node tests/deploy/validate.mjs [--root=DIR] --bin=DIR OVERLAY=RENDERED.yaml ...
//
// (tests/deploy/validate.sh renders every overlay and calls this.)
//
// 1. Every object validates against the upstream Kubernetes schemas of the
//    npm package kubernetes-models, and the cert-manager objects against
//    the CRD schemas of @kubernetes-models/cert-manager, strictly (unknown
//    fields are errors).
// 2. Policy: what a platform review checks on each overlay - grpc probes on
//    the plaintext --health_listen port, resources, security contexts,
//    grace period versus --shutdown_timeout, Prometheus annotations versus
//    --metrics_listen, topology spread, one PodDisruptionBudget per
//    workload, Services and references that resolve, secrets kept out of
//    plain values, replica counts in prod, every flag and OUTBOX_* variable
//    a flag of its binary, and the NetworkPolicies evaluated for who may
//    reach whom.
// 3. Mutual TLS on every link: each server's --tls_* files and the relay's
//    client files come from read-only mounts of Secrets that cert-manager
//    Certificates of the namespace issue, from one CA; SPIFFE ids, usages,
//    key rotation, lifetimes, DNS names versus the Services and the relay's
//    --consumer host, who each server admits (--allowed_clients,
//    --admin_clients), and the issuer chain.
// 4. Fan-out: every subscription of SUBSCRIPTIONS has a relay Deployment
//    (--subscription) that delivers to a consumer Deployment running the
//    subscription's handler (--handler) on a database of its own, each
//    consumer fed by one relay, and the NetworkPolicies keep each relay to
//    its own consumer (all relays share one identity).
// 5. The container build (deploy/docker/Dockerfile, .dockerignore) agrees
//    with the manifests (user id, binary paths, exec-form entrypoint).
// 6. Monitoring, where an overlay includes components/monitoring: the
//    prometheus-operator objects validate against the CRD schemas of
//    @kubernetes-models/prometheus-operator (as in 1); each PodMonitor
//    scrapes every outbox Deployment's "metrics" port at /metrics, with
//    job = the Deployment's name (the alerts group consumers by job); each
//    Grafana dashboard ConfigMap holds dashboard JSON.
// 7. The CronJob outbox-reconcile (outboxctl reconcile): enabled (not
//    suspended) in the base (--base=RENDERED.yaml) and every overlay, one
//    run at a time, no retry, bounded, a schedule that compares each event
//    at least twice within --window after --grace, hardened like the
//    Deployments, its flags and OUTBOX_* variables those of outboxctl's
//    --helpfull, its databases the relay's and the billing consumer's
//    Secret keys, and NetworkPolicies that let it reach DNS and PostgreSQL
//    only.
// 8. JetStream mode (components/jetstream; every relay and consumer of an
//    overlay whose name contains "jetstream"), for each relay or consumer
//    whose --jetstream is set: tls:// server URLs; --jetstream_ca (and a
//    client certificate, if any) and a .creds file from read-only Secret
//    mounts; exactly one kind of NATS credentials, a password or token
//    only from a secretKeyRef (never an argument, a literal or a
//    ConfigMap); the relay's --jetstream_replicas (>= 3 in prod), the
//    consumer's batch, ack wait and durable; stream names and subject
//    prefixes as the binaries compute them, each relay paired with the
//    one consumer reading its stream and prefix (which then counts as its
//    consumer in 4., in place of --consumer, unused in this mode), one
//    stream per subscription; and NetworkPolicies that let exactly the
//    JetStream relays and consumers reach the NATS servers' client port
//    (pods of the namespace the URL names, labelled as NATS_POD_LABELS),
//    and nothing else there.
//
// --bin=DIR: the directory of the built binaries. Each one's --helpfull
// decides which flags exist and the form of their values; a binary missing
// or printing no flags is an error.
//
// The npm packages come from tests/deploy/node_modules (`npm ci` there).
//
// Exits 0 if everything holds, 1 otherwise (2 on bad usage).

import { readFileSync, existsSync, accessSync, constants as fsConstants } from "node:fs";
import path from "node:path";
import { fileURLToPath } from "node:url";
import {
  parseDocs, ident, find, podSpecOf, matchSelector, matchServiceSelector, resolveEnv, argvOf,
  effectiveFlag, flagInArgs, parseDuration, parseHostPort, WILDCARD_HOSTS, parseQuantity, resolveTargetPort,
  workloadsForService, resolveServiceAddress, WORKLOAD_KINDS, envNameForFlag,
} from "./lib/k8s.mjs";
import { makeSchemaValidator } from "./lib/schema.mjs";
import { helpfull, ABSL_FLAGS } from "./lib/flags.mjs";
import { allowed, ingressAllowed, isolated } from "./lib/netpol.mjs";

const here = path.dirname(fileURLToPath(import.meta.url));
let root = path.resolve(here, "../..");
let binDir = null;
let baseFile = null; // the base rendered alone: only its CronJobs are checked
const overlays = [];
for (const a of process.argv.slice(2)) {
  if (a.startsWith("--root=")) root = path.resolve(a.slice(7));
  else if (a.startsWith("--bin=")) binDir = a.slice(6) ? path.resolve(a.slice(6)) : null;
  else if (a.startsWith("--base=")) baseFile = a.slice(7);
  else if (/^[\w.-]+=.+/.test(a)) {
    const i = a.indexOf("=");
    overlays.push({ name: a.slice(0, i), file: a.slice(i + 1) });
  } else {
    console.error(`usage: validate.mjs [--root=DIR] --bin=DIR OVERLAY=RENDERED.yaml ...  (bad argument: ${a})`);
    process.exit(2);
  }
}
if (overlays.length === 0 || !binDir) {
  console.error("usage: validate.mjs [--root=DIR] --bin=DIR OVERLAY=RENDERED.yaml ...  (--bin: the built binaries, whose --helpfull lists their flags)");
  process.exit(2);
}

// What the binaries are (see README / DESIGN.md section 7). A binary may
// run in several Deployments (a relay and a consumer per subscription); the
// consumer's database follows its --handler (HANDLERS).
const COMPONENTS = {
  "outbox-producer": { listen: "127.0.0.1:50051", database: "outbox_orders", needsService: true },
  "outbox-relay": { listen: "127.0.0.1:50052", database: "outbox_orders", needsService: false },
  "outbox-consumer": { listen: "127.0.0.1:50053", database: null, needsService: true },
};
// The consumer's handlers (--handler, default billing) and the database
// each one's Deployment uses: one database per consumer, since the inbox
// there records what that consumer has applied.
const HANDLERS = {
  billing: { database: "outbox_billing" },
  audit: { database: "outbox_audit" },
};
const DEFAULT_HANDLER = "billing";
const DEFAULT_SUBSCRIPTION = "billing";
// The subscriptions the manifests deliver (relay --subscription, default
// billing) and the handler of the consumer each one must reach.
const SUBSCRIPTIONS = {
  billing: { handler: "billing" },
  audit: { handler: "audit" },
};
// The flags of each binary and the form of their values, so that a typo in
// a ConfigMap key (OUTBOX_*) or an argument fails here already. The
// binaries' own --helpfull decides which flags exist; the form of a value
// follows what it prints about the flag (its default, and how its
// description starts).
const DURATION = (v) => Number.isFinite(parseDuration(v)) && parseDuration(v) >= 0;
const INT = (v) => /^\d+$/.test(v);
const FLOAT = (v) => /^-?(\d+\.?\d*|\.\d+)([eE][-+]?\d+)?$/.test(v);
const BOOL = (v) => /^(true|false|1|0|yes|no|t|f|y|n)$/i.test(v);
const HOSTPORT = (v) => parseHostPort(v) !== null;
const ANY = () => true;
const FILE = (v) => v === "" || path.isAbsolute(v);
// Identities: URI SANs (spiffe://...), DNS names or CNs, comma-separated.
const IDS = (v) => v.split(",").every((x) => /^\s*[\w.:/@-]+\s*$/.test(x));
const POSTGRES_URL = (v) => /^postgres(ql)?:\/\//.test(v);
// The form of a flag's value from the default --helpfull prints.
function validatorFromDefault(d) {
  if (/^".*"$/.test(d) || d === "") return ANY;
  if (/^(true|false)$/.test(d)) return BOOL;
  if (d === "0") return (v) => INT(v) || DURATION(v); // an int, or a duration such as --retention
  if (/^\d+$/.test(d)) return INT;
  if (FLOAT(d)) return FLOAT;
  if (Number.isFinite(parseDuration(d))) return DURATION;
  return ANY;
}
// The form of a flag's value from what --helpfull prints about it: a
// string default that is a PostgreSQL URL or a host:port; a description
// that starts "host:port" (empty allowed), "PEM" (a file: an absolute path,
// or empty) or "Comma-separated identities", or that ends with a choice
// ("Log level: trace, debug, info, warn or error."); else the default's.
function validatorFor({ dflt, help }) {
  const str = /^"(.*)"$/.exec(dflt)?.[1];
  if (str !== undefined && POSTGRES_URL(str)) return POSTGRES_URL;
  if (str && HOSTPORT(str)) return HOSTPORT;
  if (/^host:port\b/.test(help)) return (v) => v === "" || HOSTPORT(v);
  if (/^PEM\b/.test(help)) return FILE;
  if (/^Comma-separated identities\b/.test(help)) return IDS;
  const choice = /:\s+((?:[a-z]+,\s+)*[a-z]+)\s+or\s+([a-z]+)\.?$/.exec(help);
  if (choice) {
    const values = [...choice[1].split(/,\s*/), choice[2]];
    if (str === undefined || values.includes(str)) return (v) => values.includes(v);
  }
  return validatorFromDefault(dflt);
}
// Binaries that run as Jobs rather than services: outboxctl, in the CronJob
// outbox-reconcile (RECONCILE).
const TOOLS = { outboxctl: {} };
const flagSource = {};
const FLAGS = {};
for (const comp of [...Object.keys(COMPONENTS), ...Object.keys(TOOLS)]) {
  const bin = path.join(binDir, comp);
  flagSource[comp] = `${bin} --helpfull`;
  try {
    accessSync(bin, fsConstants.X_OK);
  } catch {
    console.error(`validate: ${bin} is missing or not executable: build it (its --helpfull lists the flags the manifests may use)`);
    process.exit(1);
  }
  const help = helpfull(bin);
  if (!help) {
    console.error(`validate: ${bin} --helpfull lists no flags: is it an outbox binary?`);
    process.exit(1);
  }
  FLAGS[comp] = {};
  for (const [name, f] of help) {
    if (!ABSL_FLAGS.has(name)) FLAGS[comp][name] = validatorFor(f);
  }
}
const SHUTDOWN_TIMEOUT_DEFAULT = "10s";
const GRACE_MARGIN_SECONDS = 5; // time to exit after the drain deadline
const PROD_MIN_REPLICAS = 2;
const MONITORING_NAMESPACE = "monitoring";
// prod and the overlays built on it (prod-jetstream): the prod policy
// (registry image, pre-created Secrets, replicas, an external database).
const isProd = (name) => name === "prod" || name.startsWith("prod-");
// An overlay whose name says JetStream runs every relay and consumer so.
const isJetStreamOverlay = (name) => /jetstream/.test(name);
// The NATS servers' pods, as the NATS Helm chart labels them; their
// namespace is the one the --jetstream URL's host names
// (nats.nats.svc -> nats). An overlay whose NetworkPolicy selects the
// servers by other labels needs them here too.
const NATS_POD_LABELS = { "app.kubernetes.io/name": "nats" };
const NATS_CLIENT_PORT_NAME = "client";
const NATS_OTHER_PORTS = [6222, 8222]; // cluster routes, monitoring
const JETSTREAM_PROD_MIN_REPLICAS = 3;
// Flags whose value is a credential: never a literal argument.
const CREDENTIAL_FLAG = /(password|token|secret)/i;

let passed = 0;
const failures = [];
let scope = "";
function check(cond, what) {
  if (cond) passed++;
  else failures.push(`${scope}: ${what}`);
  return !!cond;
}

// ---------------------------------------------------------------- Dockerfile
function readDockerfile() {
  const file = path.join(root, "deploy/docker/Dockerfile");
  scope = "deploy/docker/Dockerfile";
  if (!check(existsSync(file), "exists")) return null;
  const raw = readFileSync(file, "utf8");
  // Join continuation lines, drop comments.
  const lines = raw.replace(/\\\r?\n/g, " ").split(/\r?\n/).filter((l) => !/^\s*#/.test(l) && l.trim() !== "");
  const args = {};
  const stages = [];
  for (const l of lines) {
    const m = /^\s*(\w+)\s+(.*)$/.exec(l);
    if (!m) continue;
    const instr = m[1].toUpperCase();
    const rest = m[2].trim();
    if (instr === "ARG" && stages.length === 0) {
      const a = /^(\w+)(?:=(.*))?$/.exec(rest);
      if (a) args[a[1]] = (a[2] ?? "").replace(/^"|"$/g, "");
    }
    if (instr === "FROM") {
      const from = rest.replace(/\$\{(\w+)\}|\$(\w+)/g, (_, a, b) => args[a ?? b] ?? "");
      const fm = /^(?:--platform=\S+\s+)?(\S+)(?:\s+AS\s+(\S+))?$/i.exec(from);
      stages.push({ image: fm?.[1] ?? from, name: fm?.[2] ?? "", instr: [] });
      continue;
    }
    if (stages.length > 0) stages.at(-1).instr.push({ instr, rest });
  }
  check(stages.length >= 2, `is multi-stage (found ${stages.length} FROM)`);
  const builder = stages[0];
  const final = stages.at(-1);
  check(/^(docker\.io\/(library\/)?)?debian:(12|bookworm)(\b|[.-])/.test(builder?.image ?? ""), `builder stage is on debian:12 (found ${builder?.image})`);
  check(/^(docker\.io\/(library\/)?)?debian:(12|bookworm)[\w.-]*-slim|distroless/.test(final?.image ?? ""),
    `runtime stage is a slim Debian 12 or distroless image (found ${final?.image})`);
  const users = final.instr.filter((i) => i.instr === "USER");
  const user = users.at(-1)?.rest ?? "";
  const um = /^(\d+)(?::(\d+))?$/.exec(user);
  check(um && Number(um[1]) !== 0, `runtime stage ends with a numeric non-root USER (found "${user}")`);
  const eps = final.instr.filter((i) => i.instr === "ENTRYPOINT");
  let entrypoint = null;
  try {
    entrypoint = JSON.parse(eps.at(-1)?.rest ?? "null");
  } catch {
    entrypoint = null;
  }
  check(Array.isArray(entrypoint) && entrypoint.length > 0, `ENTRYPOINT is in exec (JSON array) form (found ${eps.at(-1)?.rest ?? "none"})`);
  const cmds = final.instr.filter((i) => i.instr === "CMD");
  for (const c of cmds) check(c.rest.startsWith("["), `CMD is in exec form (found ${c.rest})`);
  const finalText = final.instr.map((i) => `${i.instr} ${i.rest}`).join("\n");
  for (const bin of [...Object.keys(COMPONENTS), "outboxctl"]) {
    check(new RegExp(`COPY\\s[^\\n]*\\b${bin}\\b[^\\n]*\\s/usr/local/bin/`).test(finalText), `runtime stage copies ${bin} into /usr/local/bin/`);
  }
  const ignoreFile = path.join(root, ".dockerignore");
  scope = ".dockerignore";
  if (check(existsSync(ignoreFile), "exists")) {
    const lines = readFileSync(ignoreFile, "utf8").split(/\r?\n/).map((l) => l.trim().replace(/^\/|\/$/g, ""));
    const entries = lines.map((l) => l.replace(/^\*\*\//, ""));
    for (const e of ["build", ".local", ".git"]) check(entries.includes(e), `excludes ${e}/`);
    // The test tools' packages live in tests/deploy/node_modules; a bare
    // "node_modules" would exclude only the top level.
    check(lines.includes("**/node_modules") || lines.includes("tests/deploy/node_modules"),
      "excludes tests/deploy/node_modules/ (**/node_modules or tests/deploy/node_modules)");
  }
  return { uid: um ? Number(um[1]) : null, gid: um?.[2] ? Number(um[2]) : null, entrypoint };
}

// ---------------------------------------------------------------- per overlay
function containerSecurity(podSpec, c) {
  const pod = podSpec.securityContext ?? {};
  const sc = c.securityContext ?? {};
  check(pod.runAsNonRoot === true, "pod securityContext.runAsNonRoot is true");
  check(Number.isInteger(pod.runAsUser) && pod.runAsUser > 0, `pod securityContext.runAsUser is a numeric non-root uid (found ${pod.runAsUser})`);
  check(pod.seccompProfile?.type === "RuntimeDefault", "pod securityContext.seccompProfile is RuntimeDefault");
  const eff = (k) => sc[k] ?? pod[k];
  check(eff("runAsNonRoot") === true, `container ${c.name}: runAsNonRoot is true`);
  check(Number.isInteger(eff("runAsUser")) && eff("runAsUser") > 0, `container ${c.name}: runAsUser is a numeric non-root uid`);
  check(sc.readOnlyRootFilesystem === true, `container ${c.name}: readOnlyRootFilesystem is true`);
  check(sc.allowPrivilegeEscalation === false, `container ${c.name}: allowPrivilegeEscalation is false`);
  check(sc.privileged !== true, `container ${c.name}: not privileged`);
  check((sc.capabilities?.drop ?? []).includes("ALL"), `container ${c.name}: capabilities drop ALL`);
  check((sc.capabilities?.add ?? []).length === 0, `container ${c.name}: adds no capabilities`);
  check((sc.seccompProfile ?? pod.seccompProfile)?.type === "RuntimeDefault", `container ${c.name}: seccompProfile RuntimeDefault`);
  return eff("runAsUser");
}

function checkResources(c) {
  const r = c.resources ?? {};
  for (const kind of ["requests", "limits"]) {
    for (const res of ["cpu", "memory"]) {
      check(r[kind]?.[res] !== undefined, `container ${c.name}: resources.${kind}.${res} is set`);
    }
  }
  for (const res of ["cpu", "memory"]) {
    if (r.requests?.[res] !== undefined && r.limits?.[res] !== undefined) {
      check(parseQuantity(r.requests[res]) <= parseQuantity(r.limits[res]), `container ${c.name}: ${res} request <= limit`);
    }
  }
}

function checkImage(c, overlay) {
  const img = c.image ?? "";
  const m = /^(.*?)(?::([\w][\w.-]{0,127}))?(?:@(sha256:[0-9a-f]{64}))?$/.exec(img);
  check(m && (m[2] || m[3]), `container ${c.name}: image "${img}" has a tag or digest`);
  check(m?.[2] !== "latest", `container ${c.name}: image is not :latest`);
  check(["IfNotPresent", "Always", "Never"].includes(c.imagePullPolicy), `container ${c.name}: imagePullPolicy is explicit`);
  if (isProd(overlay)) check(m?.[1]?.includes("/") && m?.[2] !== "dev", `container ${c.name}: prod image comes from a registry, not the local dev tag (found ${img})`);
}

// With TLS on --listen, the kubelet's grpc probes (which cannot speak TLS)
// must use the plaintext --health_listen port; without TLS either port.
function checkProbes(c, listenPort, healthPort, tls) {
  for (const kind of ["startupProbe", "readinessProbe", "livenessProbe"]) {
    const p = c[kind];
    if (!check(p?.grpc, `container ${c.name}: ${kind} is a grpc probe`)) continue;
    if (tls) {
      check(p.grpc.port !== listenPort, `container ${c.name}: ${kind}.grpc.port ${p.grpc.port} is not the --listen port ${listenPort}, which serves mutual TLS (a grpc probe cannot)`);
      check(p.grpc.port === healthPort, `container ${c.name}: ${kind}.grpc.port ${p.grpc.port} equals the --health_listen port ${healthPort}`);
    } else {
      check(p.grpc.port === listenPort || p.grpc.port === healthPort, `container ${c.name}: ${kind}.grpc.port ${p.grpc.port} equals the --listen port ${listenPort} or the --health_listen port ${healthPort}`);
    }
    // Readiness is "" (the relay turns it NOT_SERVING while its consumer
    // does not answer); liveness is "liveness" (the work loops move): a
    // probe of "" there would restart every relay during a consumer outage.
    if (kind === "livenessProbe") {
      check(p.grpc.service === "liveness", `container ${c.name}: livenessProbe checks the health service "liveness" (found "${p.grpc.service ?? ""}"; "" is readiness, which a consumer outage turns NOT_SERVING on the relay)`);
    } else {
      check(!p.grpc.service, `container ${c.name}: ${kind} checks the overall health service "" (readiness)`);
    }
    if (kind !== "readinessProbe") check((p.successThreshold ?? 1) === 1, `container ${c.name}: ${kind}.successThreshold is 1`);
  }
  const s = c.startupProbe;
  if (s) {
    const budget = (s.initialDelaySeconds ?? 0) + (s.periodSeconds ?? 10) * (s.failureThreshold ?? 3);
    check(budget >= 30, `container ${c.name}: startupProbe allows >= 30 s for migrations (allows ${budget} s)`);
  }
}

// ---------------------------------------------------------------- mutual TLS
// The SPIFFE id (URI SAN) each component's certificate carries, and the
// operators' client identity.
const SPIFFE = {
  "outbox-producer": "spiffe://outbox/producer",
  "outbox-relay": "spiffe://outbox/relay",
  "outbox-consumer": "spiffe://outbox/consumer",
  outboxctl: "spiffe://outbox/outboxctl",
};
const CERT_MANAGER_API = "cert-manager.io/v1";
// The keys cert-manager writes into a Certificate's Secret.
const SECRET_KEY = { cert: "tls.crt", key: "tls.key", ca: "ca.crt" };
const MAX_LEAF_DURATION_H = 2160; // 90 days: renewal is exercised, a stolen key expires
const MIN_RENEW_BEFORE_H = 24; // a day to notice a renewal that failed

const hours = (d) => parseDuration(String(d ?? "")) / 3600;
const issuerKey = (ref) => `${ref?.group ?? "cert-manager.io"}/${ref?.kind ?? "Issuer"}/${ref?.name}`;

// Where a file a flag names comes from: the container's volumeMounts and
// the pod's volumes. Returns { mount, secretName, key, cert } or { error }.
function fileSource(podSpec, c, file, certs) {
  const mounts = (c.volumeMounts ?? []).filter((m) => file.startsWith(`${m.mountPath.replace(/\/$/, "")}/`));
  mounts.sort((a, b) => b.mountPath.length - a.mountPath.length);
  const mount = mounts[0];
  if (!mount) return { error: `no volumeMount holds ${file}` };
  const rel = file.slice(mount.mountPath.replace(/\/$/, "").length + 1);
  const vol = (podSpec.volumes ?? []).find((v) => v.name === mount.name);
  if (!vol) return { error: `volume ${mount.name} of the mount ${mount.mountPath} is not declared`, mount };
  let secretName = null;
  let key = null;
  let optional = false;
  const pick = (sec) => {
    const items = sec.items;
    if (!items || items.length === 0) return rel;
    return items.find((it) => it.path === rel)?.key ?? null;
  };
  if (vol.secret) {
    secretName = vol.secret.secretName;
    key = pick(vol.secret);
    optional = vol.secret.optional === true;
  } else if (vol.projected) {
    for (const src of vol.projected.sources ?? []) {
      if (!src.secret) continue;
      const k = pick(src.secret);
      if (k !== null && (src.secret.items?.length || !secretName)) {
        secretName = src.secret.name;
        key = k;
        optional = src.secret.optional === true;
      }
    }
  }
  if (!secretName) return { error: `volume ${vol.name} (mounted at ${mount.mountPath}) is not a Secret volume`, mount };
  const cert = certs.find((x) => x.spec?.secretName === secretName) ?? null;
  return { mount, volume: vol, secretName, key, cert, optional };
}

// The Service names a DNS name may take from a pod of `ns`.
function serviceOfDnsName(services, ns, dns) {
  for (const s of services) {
    const n = s.metadata.name;
    if ([n, `${n}.${ns}`, `${n}.${ns}.svc`, `${n}.${ns}.svc.cluster.local`].includes(dns)) return s;
  }
  return null;
}

function checkTls(name, ns, objs, found, services) {
  scope = `${name} TLS`;
  for (const o of objs) {
    if ((o.apiVersion ?? "").startsWith("cert-manager.io/")) {
      check(o.apiVersion === CERT_MANAGER_API, `${ident(o)} uses ${CERT_MANAGER_API} (found ${o.apiVersion})`);
    }
  }
  const certs = objs.filter((o) => o.apiVersion === CERT_MANAGER_API && o.kind === "Certificate");
  const issuers = objs.filter((o) => o.apiVersion === CERT_MANAGER_API && o.kind === "Issuer");
  const certOfSecret = new Map();
  for (const c of certs) {
    const prev = certOfSecret.get(c.spec?.secretName);
    check(!prev, `Certificate ${c.metadata.name}: Secret ${c.spec?.secretName} is written by no other Certificate${prev ? ` (also ${prev.metadata.name})` : ""}`);
    certOfSecret.set(c.spec?.secretName, c);
  }
  const uriOwner = new Map(); // SPIFFE id -> Certificate
  for (const c of certs) for (const u of c.spec?.uris ?? []) uriOwner.set(u, c);

  // Resolves issuerRef: the rendered namespaced Issuer, or a ClusterIssuer
  // (out of band; only noted).
  const issuerOf = (c) => {
    const ref = c.spec?.issuerRef ?? {};
    if ((ref.group ?? "cert-manager.io") !== "cert-manager.io") return { external: `${ref.kind} ${ref.name} of ${ref.group}` };
    if (ref.kind === "ClusterIssuer") return { external: `ClusterIssuer ${ref.name}` };
    return { issuer: issuers.find((i) => i.metadata.name === ref.name) ?? null };
  };
  const leafChecked = new Set();
  const checkLeaf = (c, { server, client, id, who }) => {
    const at = `Certificate ${c.metadata.name} (${who})`;
    const uris = c.spec?.uris ?? [];
    check(uris.length === 1 && uris[0] === id, `${at}: URI SAN is exactly ${id} (found ${uris.join(", ") || "none"})`);
    const usages = c.spec?.usages ?? [];
    if (server) check(usages.includes("server auth"), `${at}: usages include "server auth"`);
    if (client) check(usages.includes("client auth"), `${at}: usages include "client auth"`);
    if (leafChecked.has(c)) return;
    leafChecked.add(c);
    check(c.spec?.isCA !== true, `${at}: is not a CA`);
    const pk = c.spec?.privateKey ?? {};
    check(pk.rotationPolicy === "Always", `${at}: privateKey.rotationPolicy is Always (a new key at every renewal; found ${pk.rotationPolicy ?? "unset"})`);
    const alg = pk.algorithm ?? "RSA";
    const size = pk.size ?? (alg === "RSA" ? 2048 : 256);
    check((alg === "ECDSA" && [256, 384].includes(size)) || (alg === "RSA" && size >= 2048),
      `${at}: private key ECDSA P-256/P-384 or RSA >= 2048 (found ${alg} ${size})`);
    const d = hours(c.spec?.duration);
    const rb = hours(c.spec?.renewBefore);
    check(Number.isFinite(d) && d >= 1 && d <= MAX_LEAF_DURATION_H, `${at}: duration is set, between 1h and ${MAX_LEAF_DURATION_H}h (found ${c.spec?.duration ?? "unset"})`);
    check(Number.isFinite(rb) && rb >= MIN_RENEW_BEFORE_H && (!Number.isFinite(d) || rb < d),
      `${at}: renewBefore is set, >= ${MIN_RENEW_BEFORE_H}h and below the duration (found ${c.spec?.renewBefore ?? "unset"} of ${c.spec?.duration ?? "?"})`);
    const iss = issuerOf(c);
    if (iss.external) notes.push(`${name}: Certificate ${c.metadata.name} is issued by ${iss.external}, which is not rendered here: not checked`);
    else if (check(iss.issuer, `${at}: its issuerRef names an Issuer rendered in the namespace (found ${issuerKey(c.spec?.issuerRef)})`)) {
      check(!iss.issuer.spec?.selfSigned, `${at}: is not issued by the selfSigned Issuer ${iss.issuer.metadata.name} directly (a self-signed leaf is its own CA: peers could not verify it)`);
    }
  };

  // Every Issuer: exactly one kind of issuer; a CA Issuer's Secret comes
  // from a CA Certificate of the namespace (or is pre-created: noted).
  for (const i of issuers) {
    const kinds = ["selfSigned", "ca", "vault", "venafi", "acme"].filter((k) => i.spec?.[k] !== undefined);
    check(kinds.length === 1, `Issuer ${i.metadata.name}: configures exactly one issuer type (found ${kinds.join(", ") || "none"})`);
    if (i.spec?.ca) {
      const caCert = certOfSecret.get(i.spec.ca.secretName);
      if (!caCert) {
        notes.push(`${name}: Issuer ${i.metadata.name} signs with the pre-created Secret ${i.spec.ca.secretName} (no Certificate here issues it)`);
        continue;
      }
      check(caCert.spec?.isCA === true, `Issuer ${i.metadata.name}: its Secret ${i.spec.ca.secretName} comes from Certificate ${caCert.metadata.name} with isCA: true`);
      const up = issuerOf(caCert);
      if (!up.external) check(up.issuer, `Certificate ${caCert.metadata.name} (CA): its issuerRef names an Issuer rendered in the namespace (found ${issuerKey(caCert.spec?.issuerRef)})`);
      check(issuerKey(caCert.spec?.issuerRef) !== `cert-manager.io/Issuer/${i.metadata.name}`, `Issuer ${i.metadata.name}: does not issue its own CA certificate`);
      const caH = hours(caCert.spec?.duration ?? "2160h");
      check(caH > MAX_LEAF_DURATION_H, `Certificate ${caCert.metadata.name} (CA): lives longer than the certificates it signs (duration ${caCert.spec?.duration ?? "default 2160h"})`);
    }
  }

  // Each service: mutual TLS on --listen from a mounted Certificate Secret.
  const serverCert = {};
  const issuerSeen = new Map(); // issuerKey -> who
  const fromSecret = (comp, f, flag, want) => {
    const value = effectiveFlag(f.args, f.env, flag, "").value;
    const at = `${comp}: --${flag}`;
    if (!check(value !== "", `${at} is set (mutual TLS on by default)`)) return null;
    const spec = podSpecOf(f.workload);
    const src = fileSource(spec, f.container, value, certs);
    if (!check(!src.error, `${at}=${value} is a file of a mounted Secret${src.error ? `: ${src.error}` : ""}`)) return null;
    check(src.mount.readOnly === true, `${at}: the volumeMount ${src.mount.mountPath} is readOnly`);
    check(!src.mount.subPath && !src.mount.subPathExpr, `${at}: the volumeMount ${src.mount.mountPath} has no subPath (the kubelet never updates a subPath mount: a renewed certificate would not arrive)`);
    check(!src.optional, `${at}: the Secret volume is not optional (a pod must not start without its certificate)`);
    if (!check(src.cert, `${at}: Secret ${src.secretName} is issued by a Certificate in the namespace ${ns}`)) return null;
    check(src.key === SECRET_KEY[want], `${at}: reads the key ${SECRET_KEY[want]} of Secret ${src.secretName} (reads ${src.key})`);
    issuerSeen.set(issuerKey(src.cert.spec?.issuerRef), `${comp} --${flag}`);
    return src;
  };
  for (const [unitName, f] of Object.entries(found)) {
    const comp = f.comp;
    scope = `${name} ${unitName} TLS`;
    const cert = fromSecret(unitName, f, "tls_cert", "cert");
    const key = fromSecret(unitName, f, "tls_key", "key");
    const ca = fromSecret(unitName, f, "tls_client_ca", "ca");
    if (cert && key) check(cert.secretName === key.secretName, `--tls_cert and --tls_key come from one Secret (${cert.secretName}, ${key.secretName})`);
    if (!cert) continue;
    serverCert[unitName] = cert.cert;
    checkLeaf(cert.cert, { server: true, client: comp === "outbox-relay", id: SPIFFE[comp], who: unitName });
    // DNS names: every name the workload's Services are reached by, and
    // nothing but those names (and localhost, for kubectl port-forward).
    const dns = cert.cert.spec?.dnsNames ?? [];
    const mine = services.filter((sv) => matchServiceSelector(sv.spec?.selector, f.workload.spec.template.metadata.labels ?? {}));
    for (const sv of mine) {
      for (const n of [sv.metadata.name, `${sv.metadata.name}.${ns}.svc`, `${sv.metadata.name}.${ns}.svc.cluster.local`]) {
        check(dns.includes(n), `Certificate ${cert.cert.metadata.name}: dnsNames include ${n} (Service ${sv.metadata.name})`);
      }
    }
    for (const n of dns) {
      const sv = n === "localhost" ? null : serviceOfDnsName(services, ns, n);
      check(n === "localhost" || (sv && mine.includes(sv)), `Certificate ${cert.cert.metadata.name}: DNS name ${n} names a Service of ${unitName} in ${ns} (or localhost)`);
    }
    // Who is admitted.
    const allowed = effectiveFlag(f.args, f.env, "allowed_clients", "").value.split(",").map((x) => x.trim()).filter(Boolean);
    const admin = effectiveFlag(f.args, f.env, "admin_clients", "").value.split(",").map((x) => x.trim()).filter(Boolean);
    for (const id of [...allowed, ...admin]) {
      check(uriOwner.has(id), `--allowed_clients/--admin_clients: ${id} is the URI SAN of a Certificate rendered in ${ns}`);
    }
    if (comp === "outbox-consumer") {
      check(allowed.length > 0, "--allowed_clients is set (empty would admit every certificate of the CA, the producer's included, to EventSink)");
      check(allowed.includes(SPIFFE["outbox-relay"]), `--allowed_clients admits the relay (${SPIFFE["outbox-relay"]}); found "${allowed.join(",")}"`);
      check(!allowed.includes(SPIFFE["outbox-producer"]), "--allowed_clients does not admit the producer");
      const delivery = effectiveFlag(f.args, f.env, "delivery_clients", "").value.split(",").map((x) => x.trim()).filter(Boolean);
      const deliverers = delivery.length > 0 ? delivery : allowed;
      check(deliverers.length === 1 && deliverers[0] === SPIFFE["outbox-relay"],
        `only the relay may call EventSink.Deliver (--delivery_clients, else --allowed_clients); found "${deliverers.join(",")}"`);
    }
    if (comp === "outbox-relay") {
      check(admin.length > 0, "--admin_clients is set (who may Requeue; empty refuses it to everyone)");
      check(admin.includes(SPIFFE.outboxctl), `--admin_clients admits ${SPIFFE.outboxctl}; found "${admin.join(",")}"`);
      check(allowed.length > 0, "--allowed_clients is set (empty would let every certificate of the CA read the admin API)");
      for (const other of ["outbox-producer", "outbox-consumer"]) {
        check(!allowed.includes(SPIFFE[other]) && !admin.includes(SPIFFE[other]), `the admin API does not admit ${other}`);
      }
    }
    if (comp === "outbox-producer" && allowed.length === 0) {
      notes.push(`${name}: the producer admits every client certificate the CA signed (no --allowed_clients; deploy/README.md)`);
    }
  }

  // Each relay's stream to its consumer: TLS, its own certificate, and the
  // consumer's certificate names the host it dials.
  for (const [relayName, relay] of Object.entries(found).filter(([, f]) => f.comp === "outbox-relay")) {
    scope = `${name} ${relayName} -> ${relay.target?.metadata?.name ?? "its consumer"} TLS`;
    if (relay.js) {
      // JetStream mode: no stream to the consumer. Client files still
      // given are read at start all the same: they must be there.
      for (const [flag, want] of [["consumer_ca", "ca"], ["client_cert", "cert"], ["client_key", "key"]]) {
        if (effectiveFlag(relay.args, relay.env, flag, "").value !== "") fromSecret(relayName, relay, flag, want);
      }
      continue;
    }
    const caSrc = fromSecret(relayName, relay, "consumer_ca", "ca");
    const cc = fromSecret(relayName, relay, "client_cert", "cert");
    const ck = fromSecret(relayName, relay, "client_key", "key");
    if (cc && ck) check(cc.secretName === ck.secretName, `--client_cert and --client_key come from one Secret (${cc.secretName}, ${ck.secretName})`);
    if (cc) checkLeaf(cc.cert, { server: false, client: true, id: SPIFFE["outbox-relay"], who: "the relay's client certificate" });
    const target = effectiveFlag(relay.args, relay.env, "consumer", "127.0.0.1:50053").value;
    const host = parseHostPort(target)?.host;
    const consumerName = Object.entries(found).find(([, f]) => f.comp === "outbox-consumer" && f.workload === relay.target)?.[0];
    const consumerCert = consumerName && serverCert[consumerName];
    if (consumerCert) {
      check((consumerCert.spec?.dnsNames ?? []).includes(host),
        `the relay's --consumer host "${host}" is among the dnsNames of Certificate ${consumerCert.metadata.name} (the relay checks the name; found ${(consumerCert.spec?.dnsNames ?? []).join(", ")})`);
      if (caSrc) check(issuerKey(caSrc.cert.spec?.issuerRef) === issuerKey(consumerCert.spec?.issuerRef),
        `--consumer_ca (Secret ${caSrc.secretName}) is the CA of the issuer that signs the consumer's certificate (${issuerKey(consumerCert.spec?.issuerRef)})`);
    }
  }

  // The operators' certificate.
  scope = `${name} outboxctl TLS`;
  const ctl = uriOwner.get(SPIFFE.outboxctl);
  if (check(ctl, `a Certificate with the URI SAN ${SPIFFE.outboxctl} (the operators' outboxctl) is rendered`)) {
    checkLeaf(ctl, { server: false, client: true, id: SPIFFE.outboxctl, who: "outboxctl" });
    issuerSeen.set(issuerKey(ctl.spec?.issuerRef), "outboxctl");
  }
  // One CA: every server trusts the ca.crt of its own Secret, so every
  // certificate must come from the same issuer.
  scope = `${name} TLS`;
  check(issuerSeen.size <= 1, `every service and outboxctl certificate comes from one issuer (found ${[...issuerSeen.entries()].map(([k, v]) => `${k} for ${v}`).join("; ")})`);
}

// ---------------------------------------------------------------- JetStream
// The binaries' defaults (common/jetstream_flags.cc): stream
// OUTBOX_<NAME> (upper case, - as _), subject prefix outbox.<name>, where
// the relay's name is its --subscription and the consumer's its --handler.
const defaultStreamFor = (n) => `OUTBOX_${String(n).toUpperCase().replace(/-/g, "_")}`;
const STREAM_NAME = (v) => v !== "" && !/[.*>\s/\\]/.test(v);
const SUBJECT_PREFIX = (v) => /^[A-Za-z0-9_-]+(\.[A-Za-z0-9_-]+)*$/.test(v);
const DURABLE_NAME = (v) => v !== "" && !/[.*>\s]/.test(v);
const DEFAULT_DURABLE = "outbox-consumer";
const NATS_DEFAULT_PORT = 4222;
const subjectsOverlap = (a, b) => a === b || a.startsWith(`${b}.`) || b.startsWith(`${a}.`);

// Is a flag given at all: an argument, a resolved OUTBOX_* variable, or
// one whose Secret is not rendered (prod).
function flagSet(u, flag) {
  if (flagInArgs(u.args, flag) !== undefined) return flagInArgs(u.args, flag) !== "";
  const envName = envNameForFlag(flag);
  if (Object.prototype.hasOwnProperty.call(u.env, envName)) return u.env[envName] !== "";
  return (u.container.env ?? []).some((e) => e.name === envName && e.valueFrom);
}

// A relay's or consumer's JetStream settings, or null without --jetstream.
function jetstreamOf(u) {
  if (u.comp !== "outbox-relay" && u.comp !== "outbox-consumer") return null;
  const servers = effectiveFlag(u.args, u.env, "jetstream", "").value;
  if (!flagSet(u, "jetstream") && servers.trim() === "") return null;
  const own = u.comp === "outbox-relay" ? u.subscription : u.handler;
  return {
    servers: servers.split(",").map((x) => x.trim()).filter(Boolean),
    stream: effectiveFlag(u.args, u.env, "jetstream_stream", "").value || defaultStreamFor(own),
    subjects: effectiveFlag(u.args, u.env, "jetstream_subjects", "").value || `outbox.${own}`,
    durable: u.comp === "outbox-consumer" ? effectiveFlag(u.args, u.env, "jetstream_durable", DEFAULT_DURABLE).value : null,
    endpoints: [],
  };
}

// "tls://host:port" -> { scheme, userinfo, host, port }, or null.
function parseNatsUrl(url) {
  const m = /^(nats|tls):\/\/(?:([^@/]*)@)?(\[[^\]]+\]|[^:/@]+)(?::(\d+))?\/?$/.exec(url);
  if (!m) return null;
  return { scheme: m[1], userinfo: m[2] ?? "", host: m[3].replace(/^\[|\]$/g, ""), port: m[4] ? Number(m[4]) : NATS_DEFAULT_PORT };
}

// Where a NATS URL leads, as a NetworkPolicy endpoint: the servers' pods
// of the namespace its host names (a Service: name, name.ns,
// name.ns.svc[.cluster.local]), an address (an IPv4 literal), or null for
// a name outside the cluster (not evaluated).
function natsEndpoint(p, ns, url) {
  if (/^\d+\.\d+\.\d+\.\d+$/.test(p.host)) return { pod: false, name: `NATS ${p.host}`, ip: p.host, key: `${p.host}:${p.port}` };
  const parts = p.host.replace(/\.$/, "").split(".");
  if (parts.length > 2 && parts[2] !== "svc") return null;
  const nsName = parts.length > 1 ? parts[1] : ns;
  return {
    pod: true, name: `NATS ${p.host} (the servers' pods in namespace ${nsName})`, namespace: nsName,
    nsLabels: { "kubernetes.io/metadata.name": nsName }, labels: { ...NATS_POD_LABELS },
    ports: [{ name: NATS_CLIENT_PORT_NAME, containerPort: p.port, protocol: "TCP" }],
    key: `${nsName}:${p.port}`, url,
  };
}

// A cert-manager Certificate a JetStream client reads (the CA that
// verifies the servers, its client certificate): a leaf, renewed with a
// new key, from an issuer that resolves.
function checkNatsCertificate(name, objs, c, { client }, seen) {
  const at = `Certificate ${c.metadata.name} (NATS client)`;
  if (client) check((c.spec?.usages ?? []).includes("client auth"), `${at}: usages include "client auth"`);
  if (seen.has(c)) return;
  seen.add(c);
  check(c.spec?.isCA !== true, `${at}: is not a CA`);
  const pk = c.spec?.privateKey ?? {};
  check(pk.rotationPolicy === "Always", `${at}: privateKey.rotationPolicy is Always (found ${pk.rotationPolicy ?? "unset"})`);
  const d = hours(c.spec?.duration);
  const rb = hours(c.spec?.renewBefore);
  check(Number.isFinite(d) && d >= 1 && d <= MAX_LEAF_DURATION_H, `${at}: duration is set, between 1h and ${MAX_LEAF_DURATION_H}h (found ${c.spec?.duration ?? "unset"})`);
  check(Number.isFinite(rb) && rb >= MIN_RENEW_BEFORE_H && (!Number.isFinite(d) || rb < d),
    `${at}: renewBefore is set, >= ${MIN_RENEW_BEFORE_H}h and below the duration (found ${c.spec?.renewBefore ?? "unset"})`);
  const ref = c.spec?.issuerRef ?? {};
  if ((ref.group ?? "cert-manager.io") !== "cert-manager.io" || ref.kind === "ClusterIssuer") {
    notes.push(`${name}: ${at} is issued by ${ref.kind ?? "Issuer"} ${ref.name}, which is not rendered here: not checked (it must sign, or share a CA with, the NATS servers' certificates)`);
  } else {
    check(objs.some((o) => o.kind === "Issuer" && o.apiVersion === CERT_MANAGER_API && o.metadata?.name === ref.name),
      `${at}: its issuerRef names an Issuer rendered in the namespace (found ${issuerKey(ref)})`);
  }
}

// Every relay and consumer with --jetstream: its connection, credentials,
// stream; then each JetStream relay's consumer (by stream and prefix),
// which becomes its `target` for the fan-out checks.
function checkJetStream(name, ns, objs, found) {
  const certs = objs.filter((o) => o.apiVersion === CERT_MANAGER_API && o.kind === "Certificate");
  const seen = new Set();
  for (const [unitName, u] of Object.entries(found)) {
    if (u.comp !== "outbox-relay" && u.comp !== "outbox-consumer") continue;
    scope = `${name} ${unitName} JetStream`;
    if (isJetStreamOverlay(name)) check(u.js, `runs in JetStream mode (--jetstream is set): the overlay ${name} is a JetStream one`);
    if (!u.js) continue;
    const c = u.container;
    const spec = podSpecOf(u.workload);
    check(u.js.servers.length > 0, "--jetstream names at least one server");
    for (const url of u.js.servers) {
      const p = parseNatsUrl(url);
      if (!check(p, `--jetstream: "${url}" is a nats:// or tls:// URL of a host`)) continue;
      check(p.scheme === "tls", `--jetstream: "${url}" is tls:// (TLS to NATS, the servers verified against --jetstream_ca)`);
      check(p.userinfo === "", `--jetstream: "${url}" carries no credentials (they come from a Secret)`);
      const ep = natsEndpoint(p, ns, url);
      if (!ep) notes.push(`${name}: ${unitName} reaches NATS at ${p.host}, outside the cluster's Services: its egress is not evaluated`);
      u.js.endpoints.push({ url, port: p.port, ep });
    }
    // Files: from read-only, directory-mounted, non-optional Secrets.
    const fileFrom = (flag, want) => {
      const value = effectiveFlag(u.args, u.env, flag, "").value;
      if (value === "") return null;
      const src = fileSource(spec, c, value, certs);
      if (!check(!src.error, `--${flag}=${value} is a file of a mounted Secret${src.error ? `: ${src.error}` : ""}`)) return null;
      check(src.mount.readOnly === true, `--${flag}: the volumeMount ${src.mount.mountPath} is readOnly`);
      check(!src.mount.subPath && !src.mount.subPathExpr, `--${flag}: the volumeMount ${src.mount.mountPath} has no subPath (the kubelet never updates a subPath mount)`);
      check(!src.optional, `--${flag}: the Secret volume is not optional (a pod must not start without it)`);
      if (src.cert && want) check(src.key === SECRET_KEY[want], `--${flag}: reads the key ${SECRET_KEY[want]} of Secret ${src.secretName} (reads ${src.key})`);
      return src;
    };
    // TLS: the CA that verifies the servers; a client certificate if any.
    check(flagSet(u, "jetstream_ca"), "--jetstream_ca is set (TLS to NATS: the CA that verifies the servers)");
    const ca = fileFrom("jetstream_ca", "ca");
    if (ca?.cert) checkNatsCertificate(name, objs, ca.cert, { client: false }, seen);
    else if (ca) notes.push(`${name}: the NATS servers are verified with the key ${ca.key} of the pre-created Secret ${ca.secretName} (no Certificate here issues it)`);
    check(flagSet(u, "jetstream_cert") === flagSet(u, "jetstream_key"), "--jetstream_cert and --jetstream_key go together");
    const cert = fileFrom("jetstream_cert", "cert");
    const key = fileFrom("jetstream_key", "key");
    if (cert && key) check(cert.secretName === key.secretName, `--jetstream_cert and --jetstream_key come from one Secret (${cert.secretName}, ${key.secretName})`);
    if (cert?.cert) checkNatsCertificate(name, objs, cert.cert, { client: true }, seen);
    // Credentials: one kind; a password or token from a secretKeyRef only.
    const kinds = ["jetstream_creds", "jetstream_user", "jetstream_token"].filter((f) => flagSet(u, f));
    check(kinds.length === 1, `exactly one kind of NATS credentials: --jetstream_creds, --jetstream_user with its password, or --jetstream_token (found ${kinds.map((k) => `--${k}`).join(", ") || "none"})`);
    if (flagSet(u, "jetstream_password")) check(flagSet(u, "jetstream_user"), "--jetstream_password comes with --jetstream_user");
    for (const flag of ["jetstream_password", "jetstream_token"]) {
      if (!flagSet(u, flag)) continue;
      const envName = envNameForFlag(flag);
      check(flagInArgs(u.args, flag) === undefined, `--${flag} is not a literal argument (${envName} from a secretKeyRef)`);
      const e = (c.env ?? []).find((x) => x.name === envName);
      check(e?.valueFrom?.secretKeyRef, `${envName} comes from a secretKeyRef (found ${e ? (e.valueFrom ? Object.keys(e.valueFrom)[0] : "a literal value") : "envFrom or an argument"})`);
    }
    const creds = fileFrom("jetstream_creds", null);
    if (creds) check(!creds.cert, `--jetstream_creds: Secret ${creds.secretName} is no certificate's (a .creds file of its own)`);
    if (flagSet(u, "jetstream_user") && !flagSet(u, "jetstream_password")) notes.push(`${name}: ${unitName} connects to NATS as a user without a password`);
    // Stream and subjects, as the binaries take them.
    check(STREAM_NAME(u.js.stream), `stream "${u.js.stream}" is non-empty, without . * > / \\ or whitespace`);
    check(SUBJECT_PREFIX(u.js.subjects), `subject prefix "${u.js.subjects}" is dot-separated tokens of A-Z a-z 0-9 - _`);
    if (u.comp === "outbox-relay") {
      const r = effectiveFlag(u.args, u.env, "jetstream_replicas", "3").value;
      const n = Number(r);
      check(Number.isInteger(n) && n >= 1 && n <= 5, `--jetstream_replicas ${r} is 1-5`);
      if (isProd(name)) check(n >= JETSTREAM_PROD_MIN_REPLICAS, `prod: --jetstream_replicas ${r} >= ${JETSTREAM_PROD_MIN_REPLICAS} (an acknowledgement then means a quorum of replicas has the message; 1 would lose acknowledged events with one node)`);
      const dw = parseDuration(effectiveFlag(u.args, u.env, "jetstream_duplicate_window", "2m").value);
      check(dw > 0, `--jetstream_duplicate_window is positive (found ${dw} s)`);
    } else {
      const b = Number(effectiveFlag(u.args, u.env, "jetstream_batch", "256").value);
      check(Number.isInteger(b) && b >= 1 && b <= 1000, `--jetstream_batch ${b} is 1-1000`);
      const aw = parseDuration(effectiveFlag(u.args, u.env, "jetstream_ack_wait", "30s").value);
      check(aw >= 1, `--jetstream_ack_wait is at least 1s (found ${aw} s)`);
      check(DURABLE_NAME(u.js.durable), `--jetstream_durable "${u.js.durable}" is non-empty, without . * > or whitespace`);
    }
  }
  // Each JetStream relay: the one consumer that reads its stream.
  const jsRelays = Object.entries(found).filter(([, f]) => f.comp === "outbox-relay" && f.js);
  const jsConsumers = Object.entries(found).filter(([, f]) => f.comp === "outbox-consumer" && f.js);
  const sameServers = (a, b) => a.length === b.length && [...a].sort().every((x, i) => x === [...b].sort()[i]);
  for (const [rName, r] of jsRelays) {
    scope = `${name} ${rName} JetStream`;
    const readers = jsConsumers.filter(([, f]) => f.js.stream === r.js.stream);
    r.target = null;
    if (!check(readers.length === 1, `exactly one JetStream consumer Deployment reads its stream ${r.js.stream} (found ${readers.map(([n]) => n).join(", ") || "none"})`)) continue;
    const [cName, con] = readers[0];
    check(con.js.subjects === r.js.subjects, `${cName} reads the subjects ${r.js.subjects}.> it publishes (its prefix: ${con.js.subjects})`);
    check(sameServers(con.js.servers, r.js.servers), `${cName} connects to the NATS servers it publishes to (${r.js.servers.join(",")}; ${cName}: ${con.js.servers.join(",")})`);
    r.target = con.workload;
  }
  for (let i = 0; i < jsRelays.length; i++) {
    for (let j = i + 1; j < jsRelays.length; j++) {
      const [a, fa] = jsRelays[i];
      const [b, fb] = jsRelays[j];
      if (fa.subscription === fb.subscription) continue; // the fan-out check reports two relays of one subscription
      scope = `${name} JetStream`;
      check(fa.js.stream !== fb.js.stream, `${a} and ${b} (subscriptions ${fa.subscription}, ${fb.subscription}) publish to streams of their own (both: ${fa.js.stream})`);
      check(!subjectsOverlap(fa.js.subjects, fb.js.subjects), `${a} and ${b} publish under subject prefixes apart (${fa.js.subjects}, ${fb.js.subjects}): NATS refuses streams with overlapping subjects`);
    }
  }
}

function componentOf(container) {
  const bin = path.basename(container.command?.[0] ?? "");
  return COMPONENTS[bin] ? bin : null;
}

async function validateOverlay(name, file, validator, docker) {
  scope = `${name}`;
  const objs = parseDocs(readFileSync(file, "utf8"), file);
  check(objs.length > 0, "renders at least one object");

  // 1. Schemas.
  let schemaOk = 0;
  for (const o of objs) {
    scope = `${name} ${ident(o)}`;
    const errs = await validator.validate(o);
    if (errs.length === 0) schemaOk++;
    for (const e of errs) check(false, `schema: ${e}`);
    if (errs.length === 0) passed++;
  }

  // Namespace(s).
  scope = name;
  const namespaces = new Set(objs.map((o) => o.metadata?.namespace).filter(Boolean));
  check(namespaces.size === 1, `all namespaced objects are in one namespace (found ${[...namespaces].join(", ") || "none"})`);
  const ns = [...namespaces][0] ?? "default";
  const nsObj = find(objs, "Namespace", ns);
  const nsLabels = { "kubernetes.io/metadata.name": ns, ...(nsObj?.metadata?.labels ?? {}) };
  if (check(nsObj, `renders its Namespace ${ns}`)) {
    check(nsLabels["pod-security.kubernetes.io/enforce"] === "restricted", `Namespace ${ns} enforces the restricted Pod Security Standard`);
  }

  // Unique names per kind.
  const seen = new Set();
  for (const o of objs) {
    const k = `${o.kind}/${o.metadata?.namespace ?? ""}/${o.metadata?.name}`;
    check(!seen.has(k), `${ident(o)} rendered once`);
    seen.add(k);
  }

  const workloads = objs.filter((o) => WORKLOAD_KINDS.has(o.kind));
  const deployments = objs.filter((o) => o.kind === "Deployment");
  const pdbs = objs.filter((o) => o.kind === "PodDisruptionBudget");
  const services = objs.filter((o) => o.kind === "Service");
  const policies = objs.filter((o) => o.kind === "NetworkPolicy");
  const found = {};

  // 2. Every workload (Deployments and the dev PostgreSQL StatefulSet).
  for (const w of workloads) {
    scope = `${name} ${ident(w)}`;
    const spec = podSpecOf(w);
    const labels = w.spec?.template?.metadata?.labels ?? {};
    check(matchSelector(w.spec?.selector, labels), "spec.selector matches its pod template labels");
    check(spec.automountServiceAccountToken === false, "automountServiceAccountToken is false");
    check(spec.enableServiceLinks === false, "enableServiceLinks is false (service link variables would be read as OUTBOX_* flags)");
    check(Number.isInteger(spec.terminationGracePeriodSeconds), "terminationGracePeriodSeconds is set");
    check((spec.containers ?? []).length > 0, "has containers");
    for (const c of [...(spec.initContainers ?? []), ...(spec.containers ?? [])]) {
      const uid = containerSecurity(spec, c);
      checkResources(c);
      checkImage(c, name);
      const { env, sources, missing } = resolveEnv(c, objs);
      for (const m of missing) {
        const okOutOfBand = isProd(name) && m.kind === "secret" && !m.rendered;
        check(okOutOfBand, `container ${c.name}: reference to ${m.kind} ${m.name}${m.key ? ` key ${m.key}` : ""} resolves`);
      }
      // Credentials only from Secrets.
      for (const e of c.env ?? []) {
        if (/PASSWORD|SECRET|TOKEN|^OUTBOX_DB$/.test(e.name)) {
          check(e.valueFrom?.secretKeyRef, `container ${c.name}: ${e.name} comes from a Secret`);
        }
      }
      for (const [k, v] of Object.entries(env)) {
        if (!String(sources[k]).startsWith("secret:")) {
          check(!/:\/\/[^/@\s:]+:[^/@\s]+@/.test(v), `container ${c.name}: ${k} (${sources[k]}) holds no URL with a password`);
        }
        // A credential from envFrom: a Secret's, never a ConfigMap's.
        if (/PASSWORD|SECRET|TOKEN/.test(k) && !(c.env ?? []).some((e) => e.name === k)) {
          check(String(sources[k]).startsWith("secret:"), `container ${c.name}: ${k} comes from a Secret (found ${sources[k]})`);
        }
      }
      const comp = componentOf(c);
      if (!comp) {
        for (const kind of ["startupProbe", "readinessProbe", "livenessProbe"]) check(c[kind], `container ${c.name}: has a ${kind}`);
        continue;
      }
      // ---- an outbox service container
      check(!found[w.metadata.name], `${ident(w)} runs one outbox container`);
      const unit = { comp, workload: w, container: c, env, args: argvOf(c, env).args };
      found[w.metadata.name] = unit;
      check(w.kind === "Deployment", `${comp} is a Deployment`);
      // Which subscription a relay delivers, which handler a consumer runs.
      if (comp === "outbox-relay") unit.subscription = effectiveFlag(unit.args, env, "subscription", DEFAULT_SUBSCRIPTION).value;
      if (comp === "outbox-consumer") {
        unit.handler = effectiveFlag(unit.args, env, "handler", DEFAULT_HANDLER).value;
        check(HANDLERS[unit.handler], `container ${c.name}: --handler "${unit.handler}" is one of ${Object.keys(HANDLERS).join(", ")}`);
      }
      // Where its database URL comes from (a Secret key, or a literal), to
      // tell consumers' databases apart where the Secret is not rendered.
      const dbRef = (c.env ?? []).find((e) => e.name === "OUTBOX_DB")?.valueFrom?.secretKeyRef;
      unit.dbSource = flagInArgs(unit.args, "db") ?? (dbRef ? `secret ${dbRef.name} key ${dbRef.key}` : env.OUTBOX_DB ?? "");
      if (docker) {
        check(docker.uid === null || uid === docker.uid, `container ${c.name}: runAsUser ${uid} equals the image's USER ${docker.uid}`);
      }
      const { args } = argvOf(c, env);
      const known = FLAGS[comp];
      if (!check(known, `${flagSource[comp]} lists the flags of ${comp}`)) continue;
      for (const [k, v] of Object.entries(env)) {
        if (!k.startsWith("OUTBOX_")) continue;
        const flag = k.slice(7).toLowerCase();
        if (check(known[flag], `container ${c.name}: ${k} (${sources[k]}) is a flag of ${comp} (per ${flagSource[comp]})`)) {
          check(known[flag](v), `container ${c.name}: ${k}="${v}" is a valid --${flag} value`);
        }
      }
      // Variables whose Secret is not rendered (prod): their names at least.
      for (const e of c.env ?? []) {
        if (!e.name.startsWith("OUTBOX_") || Object.prototype.hasOwnProperty.call(env, e.name)) continue;
        const ref = e.valueFrom?.secretKeyRef ?? e.valueFrom?.configMapKeyRef;
        check(known[e.name.slice(7).toLowerCase()], `container ${c.name}: ${e.name} (${ref ? `${e.valueFrom.secretKeyRef ? "secret" : "configmap"} ${ref.name} key ${ref.key}` : "runtime"}) is a flag of ${comp} (per ${flagSource[comp]})`);
      }
      for (const a of args) {
        const m = /^--?([A-Za-z0-9_]+)(?:=(.*))?$/s.exec(a);
        if (!m) continue;
        if (check(known[m[1]], `container ${c.name}: argument --${m[1]} is a flag of ${comp} (per ${flagSource[comp]})`) && m[2] !== undefined) {
          check(known[m[1]](m[2]), `container ${c.name}: --${m[1]}="${m[2]}" is a valid value`);
        }
        if (CREDENTIAL_FLAG.test(m[1])) {
          check(false, `container ${c.name}: --${m[1]} is not a literal argument (a credential: ${envNameForFlag(m[1])} from a secretKeyRef)`);
        }
      }
      unit.js = jetstreamOf(unit);
      const listen = effectiveFlag(args, env, "listen", COMPONENTS[comp].listen);
      const lhp = parseHostPort(listen.value);
      check(lhp, `container ${c.name}: --listen "${listen.value}" is host:port`);
      check(lhp && WILDCARD_HOSTS.has(lhp.host), `container ${c.name}: --listen binds all addresses (found "${listen.value}" from ${listen.source}); probes and Services reach the pod IP`);
      const ports = c.ports ?? [];
      const grpcPort = ports.find((p) => p.containerPort === lhp?.port);
      check(grpcPort, `container ${c.name}: declares the --listen port ${lhp?.port} in ports`);
      check(grpcPort?.name === "grpc", `container ${c.name}: the --listen port is named "grpc"`);
      const tlsOn = effectiveFlag(args, env, "tls_cert", "").value !== "";
      const health = effectiveFlag(args, env, "health_listen", "");
      const hhp = parseHostPort(health.value);
      if (tlsOn) check(hhp, `container ${c.name}: --health_listen is set (TLS on --listen: the kubelet's grpc probes need a plaintext port; found "${health.value}")`);
      if (hhp) {
        check(WILDCARD_HOSTS.has(hhp.host), `container ${c.name}: --health_listen binds all addresses (the kubelet probes the pod IP; found "${health.value}")`);
        const healthPort = ports.find((p) => p.containerPort === hhp.port);
        check(healthPort?.name === "health", `container ${c.name}: declares the --health_listen port ${hhp.port} as a port named "health"`);
        check(hhp.port !== lhp?.port, `container ${c.name}: --health_listen and --listen ports differ`);
        // Plaintext and unauthenticated: for the kubelet only, never behind a Service.
        for (const s of services.filter((sv) => matchServiceSelector(sv.spec?.selector, w.spec.template.metadata.labels ?? {}))) {
          for (const sp of s.spec.ports ?? []) {
            const r = resolveTargetPort(spec, sp.targetPort ?? sp.port, sp.protocol ?? "TCP");
            check(r?.port?.containerPort !== hhp.port, `Service ${s.metadata.name} port ${sp.port} does not publish the plaintext health port ${hhp.port}`);
          }
        }
      }
      if (lhp) checkProbes(c, lhp.port, hhp?.port, tlsOn);

      const metrics = effectiveFlag(args, env, "metrics_listen", "");
      const mhp = parseHostPort(metrics.value);
      check(mhp, `container ${c.name}: --metrics_listen is set (found "${metrics.value}" from ${metrics.source})`);
      check(mhp && WILDCARD_HOSTS.has(mhp.host), `container ${c.name}: --metrics_listen binds all addresses`);
      const metricsPort = ports.find((p) => p.containerPort === mhp?.port);
      check(metricsPort?.name === "metrics", `container ${c.name}: declares the --metrics_listen port ${mhp?.port} as a port named "metrics"`);
      const ann = w.spec?.template?.metadata?.annotations ?? {};
      check(ann["prometheus.io/scrape"] === "true", 'pod annotation prometheus.io/scrape is "true"');
      check(ann["prometheus.io/port"] === String(mhp?.port), `pod annotation prometheus.io/port equals the metrics port ${mhp?.port} (found ${ann["prometheus.io/port"]})`);
      check(ann["prometheus.io/path"] === "/metrics", "pod annotation prometheus.io/path is /metrics");
      check(lhp?.port !== mhp?.port, `container ${c.name}: gRPC and metrics ports differ`);
      if (hhp) check(hhp.port !== mhp?.port, `container ${c.name}: health and metrics ports differ`);

      const st = effectiveFlag(args, env, "shutdown_timeout", SHUTDOWN_TIMEOUT_DEFAULT);
      const stSec = parseDuration(st.value);
      check(Number.isFinite(stSec) && stSec > 0, `container ${c.name}: --shutdown_timeout "${st.value}" is a finite duration`);
      const preStop = c.lifecycle?.preStop?.sleep?.seconds ?? 0;
      check(!c.lifecycle?.preStop?.exec, `container ${c.name}: no exec preStop hook (the image has no shell)`);
      const grace = spec.terminationGracePeriodSeconds ?? 30;
      check(grace >= preStop + stSec + GRACE_MARGIN_SECONDS,
        `terminationGracePeriodSeconds ${grace} > preStop sleep ${preStop} s + --shutdown_timeout ${stSec} s (from ${st.source}) + ${GRACE_MARGIN_SECONDS} s margin`);

      // Database URL: from the Secret; in dev it must resolve to the
      // rendered PostgreSQL Service and the component's database.
      const db = effectiveFlag(args, env, "db", "");
      if (isProd(name)) {
        check(db.source === "args" || (c.env ?? []).some((e) => e.name === "OUTBOX_DB" && e.valueFrom?.secretKeyRef),
          `container ${c.name}: --db comes from the Secret`);
      } else {
        let u = null;
        try {
          u = new URL(db.value);
        } catch {
          u = null;
        }
        if (check(u && /^postgres(ql)?:$/.test(u.protocol), `container ${c.name}: --db "${db.value}" is a postgresql:// URL`)) {
          const wantDb = comp === "outbox-consumer" ? HANDLERS[found[w.metadata.name].handler]?.database : COMPONENTS[comp].database;
          if (wantDb) check(decodeURIComponent(u.pathname.slice(1)) === wantDb, `container ${c.name}: --db names the database ${wantDb}`);
          check(u.password === "", `container ${c.name}: --db URL carries no password (PGPASSWORD does)`);
          check(env.PGPASSWORD !== undefined, `container ${c.name}: PGPASSWORD is set`);
          const r = resolveServiceAddress(objs, ns, `${u.hostname}:${u.port || 5432}`);
          check(r?.workload, `container ${c.name}: --db host ${u.hostname}:${u.port || 5432} is a rendered Service with a backing pod`);
          if (r?.workload) {
            check(r.container?.image?.includes("postgres:15"), `container ${c.name}: --db reaches PostgreSQL 15 (found ${r.container?.image})`);
            if (r.workload.kind === "StatefulSet") {
              const pgEnv = resolveEnv(r.container, objs).env;
              check(pgEnv.POSTGRES_PASSWORD === env.PGPASSWORD && pgEnv.POSTGRES_USER === decodeURIComponent(u.username),
                `container ${c.name}: --db user and PGPASSWORD match the dev PostgreSQL's POSTGRES_USER/POSTGRES_PASSWORD`);
            }
          }
        }
      }

      // In JetStream mode --consumer is unused: the relay's consumer is the
      // one reading its stream (checkJetStream).
      if (comp === "outbox-relay" && unit.js) unit.target = null;
      if (comp === "outbox-relay" && !unit.js) {
        const target = effectiveFlag(args, env, "consumer", "127.0.0.1:50053");
        const r = resolveServiceAddress(objs, ns, target.value);
        check(r?.workload, `--consumer "${target.value}" is a rendered Service with a backing pod`);
        found[w.metadata.name].target = r?.workload ?? null;
        if (r?.workload) {
          const cc = r.workload.spec.template.spec.containers.find((x) => componentOf(x) === "outbox-consumer");
          const cEnv = cc ? resolveEnv(cc, objs).env : {};
          const cListen = cc ? parseHostPort(effectiveFlag(argvOf(cc, cEnv).args, cEnv, "listen", COMPONENTS["outbox-consumer"].listen).value) : null;
          check(cc && r.containerPort === cListen?.port, `--consumer "${target.value}" reaches the consumer's --listen port ${cListen?.port} (reaches ${r.containerPort})`);
        }
      }
    }
  }

  // The dev PostgreSQL: storage, and the databases created at first start.
  for (const s of objs.filter((o) => o.kind === "StatefulSet")) {
    scope = `${name} ${ident(s)}`;
    check((s.spec.volumeClaimTemplates ?? []).length > 0, "has a volumeClaimTemplate");
    check(s.spec.replicas === 1, "runs a single instance");
    const c = s.spec.template.spec.containers[0];
    const initMount = (c.volumeMounts ?? []).find((m) => m.mountPath === "/docker-entrypoint-initdb.d");
    const vol = initMount && (s.spec.template.spec.volumes ?? []).find((v) => v.name === initMount.name);
    const cm = vol?.configMap && find(objs, "ConfigMap", vol.configMap.name);
    if (check(cm, "mounts a rendered ConfigMap at /docker-entrypoint-initdb.d")) {
      const sql = Object.values(cm.data ?? {}).join("\n");
      const wanted = new Set([COMPONENTS["outbox-producer"].database, ...Object.values(SUBSCRIPTIONS).map((x) => HANDLERS[x.handler].database)]);
      for (const dbName of wanted) {
        check(new RegExp(`CREATE\\s+DATABASE\\s+"?${dbName}\\b`, "i").test(sql), `the init script creates the database ${dbName}`);
      }
    }
  }

  // 3. The three components (each in one Deployment or more), replicas,
  // spread, budgets, Services.
  for (const comp of Object.keys(COMPONENTS)) {
    scope = `${name} ${comp}`;
    check(Object.values(found).some((f) => f.comp === comp), `a Deployment runs ${comp}`);
  }
  for (const [unitName, f] of Object.entries(found)) {
    const comp = f.comp;
    scope = `${name} ${unitName}`;
    const w = f.workload;
    const labels = w.spec.template.metadata.labels ?? {};
    const replicas = w.spec.replicas ?? 1;
    if (isProd(name)) check(replicas >= PROD_MIN_REPLICAS, `prod runs >= ${PROD_MIN_REPLICAS} replicas (found ${replicas})`);
    const tsc = (w.spec.template.spec.topologySpreadConstraints ?? []).find((t) => t.topologyKey === "kubernetes.io/hostname");
    if (check(tsc, "has a topologySpreadConstraint on kubernetes.io/hostname")) {
      check(tsc.maxSkew === 1, "hostname spread maxSkew is 1");
      check(matchSelector(tsc.labelSelector, labels), "hostname spread labelSelector selects its own pods");
      if (isProd(name)) check(tsc.whenUnsatisfiable === "DoNotSchedule", "prod hostname spread is DoNotSchedule");
    }
    const mine = pdbs.filter((p) => matchSelector(p.spec?.selector, labels));
    check(mine.length === 1, `exactly one PodDisruptionBudget selects its pods (found ${mine.length})`);
    for (const p of mine) {
      const minAvail = p.spec.minAvailable;
      const maxUnavail = p.spec.maxUnavailable;
      const num = (v, n) => (typeof v === "string" && v.endsWith("%") ? Math.floor((parseInt(v, 10) * n) / 100) : Number(v));
      if (minAvail !== undefined) {
        check(num(minAvail, replicas) < replicas, `PDB ${p.metadata.name} lets a node drain proceed (minAvailable ${minAvail} < replicas ${replicas})`);
        if (replicas >= 2) check(num(minAvail, replicas) >= 1, `PDB ${p.metadata.name} keeps a replica up`);
      } else {
        check(num(maxUnavail, replicas) >= 1, `PDB ${p.metadata.name} lets a node drain proceed (maxUnavailable ${maxUnavail})`);
        if (replicas >= 2) check(num(maxUnavail, replicas) < replicas, `PDB ${p.metadata.name} keeps a replica up (maxUnavailable ${maxUnavail} < replicas ${replicas})`);
      }
    }
    const svc = services.filter((s) => matchServiceSelector(s.spec?.selector, labels));
    if (COMPONENTS[comp].needsService) {
      const lp = parseHostPort(effectiveFlag(f.args, f.env, "listen", COMPONENTS[comp].listen).value)?.port;
      check(svc.some((s) => s.metadata.name === unitName && (s.spec.ports ?? []).some((p) => p.port === lp)), `a Service ${unitName} exposes port ${lp}`);
    }
  }

  // JetStream mode: the NATS connection, and each relay's consumer by stream.
  checkJetStream(name, ns, objs, found);

  // Fan-out: one relay Deployment per subscription, each delivering to a
  // consumer Deployment of the subscription's handler, each consumer fed by
  // exactly one relay and on a database of its own.
  scope = `${name} subscriptions`;
  const relays = Object.entries(found).filter(([, f]) => f.comp === "outbox-relay");
  const consumers = Object.entries(found).filter(([, f]) => f.comp === "outbox-consumer");
  const unitOf = (workload) => Object.entries(found).find(([, f]) => f.workload === workload) ?? [];
  for (const [sub, want] of Object.entries(SUBSCRIPTIONS)) {
    const mine = relays.filter(([, f]) => f.subscription === sub);
    if (!check(mine.length === 1, `exactly one relay Deployment delivers the subscription ${sub} (found ${mine.map(([n]) => n).join(", ") || "none"})`)) continue;
    const [rName, rel] = mine[0];
    const [cName, con] = unitOf(rel.target);
    const via = rel.js ? `its stream ${rel.js.stream} is read by` : "--consumer reaches";
    if (check(con?.comp === "outbox-consumer", `${rName} (subscription ${sub}) delivers to a consumer Deployment (${via} ${cName ?? "nothing"})`)) {
      check(con.handler === want.handler, `${rName} (subscription ${sub}) delivers to a consumer with --handler=${want.handler} (${cName} runs ${con.handler})`);
    }
  }
  for (const [rName, rel] of relays) {
    check(SUBSCRIPTIONS[rel.subscription], `${rName}: --subscription "${rel.subscription}" is one of ${Object.keys(SUBSCRIPTIONS).join(", ")}`);
  }
  for (const [cName, con] of consumers) {
    const feeders = relays.filter(([, f]) => f.target === con.workload).map(([n]) => n);
    check(feeders.length === 1, `${cName} is fed by exactly one relay Deployment (found ${feeders.join(", ") || "none"}): a consumer fed two subscriptions would take the second's events for duplicates`);
  }
  for (let i = 0; i < consumers.length; i++) {
    for (let j = i + 1; j < consumers.length; j++) {
      const [a, fa] = consumers[i];
      const [b, fb] = consumers[j];
      check(fa.dbSource !== fb.dbSource, `${a} and ${b} take their database from different places (both: ${fa.dbSource}): each consumer's inbox must be its own`);
    }
  }

  // Every Service selects exactly one workload and its ports resolve.
  for (const s of services) {
    scope = `${name} ${ident(s)}`;
    const ws = workloadsForService(objs, s);
    check(ws.length === 1, `selects exactly one workload (found ${ws.length})`);
    for (const p of s.spec.ports ?? []) {
      const r = ws[0] && resolveTargetPort(podSpecOf(ws[0]), p.targetPort ?? p.port, p.protocol ?? "TCP");
      check(r, `port ${p.port} -> targetPort ${p.targetPort ?? p.port} is a declared container port`);
    }
  }
  // Every PDB selects some workload.
  for (const p of pdbs) {
    scope = `${name} ${ident(p)}`;
    check(workloads.some((w) => matchSelector(p.spec?.selector, w.spec.template.metadata.labels)), "selects a workload's pods");
  }

  // Mutual TLS on every link, certificates from cert-manager.
  checkTls(name, ns, objs, found, services);

  // 4. Secrets: dev generates one; prod must not carry any.
  scope = name;
  const secrets = objs.filter((o) => o.kind === "Secret");
  if (isProd(name)) {
    check(secrets.length === 0, `renders no Secret (prod expects a pre-created one; found ${secrets.map((s) => s.metadata.name).join(", ")})`);
    const refs = new Set();
    for (const f of Object.values(found)) {
      for (const e of f.container.env ?? []) if (e.valueFrom?.secretKeyRef) refs.add(`${e.valueFrom.secretKeyRef.name}/${e.valueFrom.secretKeyRef.key}`);
    }
    check(refs.size > 0, "services read credentials from a Secret");
    // Secret volumes no Certificate of the overlay writes (the NATS .creds).
    const issued = new Set(objs.filter((o) => o.kind === "Certificate").map((o) => o.spec?.secretName));
    for (const f of Object.values(found)) {
      for (const v of podSpecOf(f.workload).volumes ?? []) {
        if (!v.secret || issued.has(v.secret.secretName)) continue;
        const items = v.secret.items ?? [];
        if (items.length === 0) refs.add(`${v.secret.secretName}/*`);
        for (const it of items) refs.add(`${v.secret.secretName}/${it.key}`);
      }
    }
    expectedSecretKeys(name).push(...refs);
  }

  // The reconcile CronJob.
  const cronJobs = objs.filter((o) => o.kind === "CronJob");
  const reconcilers = checkCronJobs(name, objs, cronJobs, found, docker);
  if (isProd(name)) {
    for (const r of reconcilers) {
      for (const e of r.container.env ?? []) if (e.valueFrom?.secretKeyRef) expectedSecretKeys(name).push(`${e.valueFrom.secretKeyRef.name}/${e.valueFrom.secretKeyRef.key}`);
    }
  }

  // 5. NetworkPolicies, evaluated.
  scope = `${name} NetworkPolicy`;
  check(policies.some((p) => Object.keys(p.spec?.podSelector ?? {}).length === 0 && (p.spec.policyTypes ?? []).includes("Ingress") && !(p.spec.ingress ?? []).length),
    "a default-deny ingress policy selects every pod");
  check(policies.some((p) => Object.keys(p.spec?.podSelector ?? {}).length === 0 && (p.spec.policyTypes ?? []).includes("Egress") && !(p.spec.egress ?? []).length),
    "a default-deny egress policy selects every pod");
  const podEp = (w) => ({
    pod: true, name: w.metadata.name, namespace: ns, nsLabels,
    labels: w.spec.template.metadata.labels ?? {},
    ports: w.spec.template.spec.containers.flatMap((c) => c.ports ?? []),
  });
  const jobEp = (cj) => ({
    pod: true, name: cj.metadata.name, namespace: ns, nsLabels,
    labels: cronPodTemplate(cj)?.metadata?.labels ?? {},
    ports: (cronPodTemplate(cj)?.spec?.containers ?? []).flatMap((c) => c.ports ?? []),
  });
  for (const w of workloads) {
    check(isolated(policies, podEp(w), "Ingress"), `${ident(w)} pods are isolated for ingress`);
    check(isolated(policies, podEp(w), "Egress"), `${ident(w)} pods are isolated for egress`);
  }
  for (const cj of cronJobs) {
    check(isolated(policies, jobEp(cj), "Ingress"), `${ident(cj)} pods are isolated for ingress`);
    check(isolated(policies, jobEp(cj), "Egress"), `${ident(cj)} pods are isolated for egress`);
  }
  const eps = {};
  for (const [unitName, f] of Object.entries(found)) eps[unitName] = { ...podEp(f.workload), unit: unitName, comp: f.comp, workload: f.workload, target: f.target, js: f.js };
  const portOf = (ep, pname) => (ep?.ports ?? []).find((p) => p.name === pname)?.containerPort;
  const strangerPod = { pod: true, name: "another pod of the namespace", namespace: ns, nsLabels, labels: { app: "something-else" }, ports: [] };
  const foreignPod = { pod: true, name: "a pod of another namespace", namespace: "elsewhere", nsLabels: { "kubernetes.io/metadata.name": "elsewhere" }, labels: { "app.kubernetes.io/name": "outbox-relay" }, ports: [] };
  const prometheus = { pod: true, name: "prometheus (namespace monitoring)", namespace: MONITORING_NAMESPACE, nsLabels: { "kubernetes.io/metadata.name": MONITORING_NAMESPACE }, labels: { "app.kubernetes.io/name": "prometheus" }, ports: [] };
  const kubeDns = { pod: true, name: "kube-dns", namespace: "kube-system", nsLabels: { "kubernetes.io/metadata.name": "kube-system" }, labels: { "k8s-app": "kube-dns" }, ports: [{ name: "dns", containerPort: 53, protocol: "UDP" }, { name: "dns-tcp", containerPort: 53, protocol: "TCP" }] };
  const outsider = { pod: false, name: "a client outside the cluster", ip: "198.51.100.7" };
  const externalDb = { pod: false, name: "an external PostgreSQL", ip: "203.0.113.10" };
  const internet = { pod: false, name: "an arbitrary external address", ip: "192.0.2.80" };
  // For a source that is one of this overlay's workloads both its egress and
  // the destination's ingress must admit the connection; for any other
  // source only the destination's ingress is ours to judge.
  const ours = (ep) => ep.pod && ep.namespace === ns && [...workloads, ...cronJobs].some((w) => w.metadata.name === ep.name);
  const expect = (src, dst, port, proto, want) => {
    const got = ours(src) ? allowed(policies, src, dst, port, proto) : ingressAllowed(policies, src, dst, port, proto);
    check(got === want, `${src.name} -> ${dst.name}:${port}/${proto} is ${want ? "allowed" : "denied"} (policies ${got ? "allow" : "deny"} it)`);
  };
  const Ps = Object.values(eps).filter((e) => e.comp === "outbox-producer");
  const Rs = Object.values(eps).filter((e) => e.comp === "outbox-relay");
  const Cs = Object.values(eps).filter((e) => e.comp === "outbox-consumer");
  const all = [...Ps, ...Rs, ...Cs];
  if (Ps.length && Rs.length && Cs.length) {
    // Producer: open to clients ...
    for (const P of Ps) {
      const pg = portOf(P, "grpc");
      for (const src of [outsider, strangerPod, foreignPod]) expect(src, P, pg, "TCP", true);
      // ... but the other components have no reason to call it.
      for (const src of [...Rs, ...Cs]) expect(src, P, pg, "TCP", false);
    }
    // Each consumer: its own subscription's relay only. Every relay
    // presents the same identity, so these rules alone keep a relay from
    // delivering into another subscription's consumer.
    for (const C of Cs) {
      const cg = portOf(C, "grpc");
      for (const R of Rs) {
        // A JetStream relay does not dial its consumer (--consumer is
        // unused): that path may stay open or be closed; any other is shut.
        if (R.js && R.target === C.workload) continue;
        expect(R, C, cg, "TCP", R.target === C.workload);
      }
      for (const src of [...Ps, ...Cs.filter((x) => x !== C), strangerPod, foreignPod, outsider, prometheus]) expect(src, C, cg, "TCP", false);
    }
    // Relay admin: no in-cluster client.
    for (const R of Rs) {
      const rg = portOf(R, "grpc");
      for (const src of [...Ps, ...Cs, ...Rs.filter((x) => x !== R), strangerPod, outsider]) expect(src, R, rg, "TCP", false);
    }
    // Metrics: this namespace and the monitoring namespace.
    for (const dst of all) {
      const mp = portOf(dst, "metrics");
      expect(prometheus, dst, mp, "TCP", true);
      expect(strangerPod, dst, mp, "TCP", true);
      expect(foreignPod, dst, mp, "TCP", false);
      expect(outsider, dst, mp, "TCP", false);
    }
    // Health: plaintext and unauthenticated, for the kubelet only (its
    // probes come from the node, which NetworkPolicy always admits).
    for (const dst of all) {
      const hp = portOf(dst, "health");
      if (hp === undefined) continue;
      for (const src of [outsider, strangerPod, foreignPod, prometheus, ...all.filter((x) => x !== dst)]) expect(src, dst, hp, "TCP", false);
    }
    // Egress.
    for (const src of all) {
      expect(src, kubeDns, 53, "UDP", true);
      expect(src, kubeDns, 53, "TCP", true);
      expect(src, internet, 443, "TCP", false);
      expect(src, strangerPod, 8080, "TCP", false);
    }
    // The reconcile Jobs: DNS and PostgreSQL, nothing else, and no
    // connection to them.
    const Js = reconcilers.map((r) => jobEp(r.cronJob));
    // NATS (JetStream mode): each JetStream relay and consumer reaches the
    // servers' client port, not their other ports, not that port anywhere
    // else (another namespace's pods labelled alike, an arbitrary
    // address); the producer, the Jobs and services not in JetStream mode
    // do not reach NATS at all.
    const natsEps = new Map();
    for (const X of all) for (const n of X.js?.endpoints ?? []) if (n.ep) natsEps.set(n.ep.key, n);
    for (const X of all.filter((x) => x.js)) {
      for (const n of X.js.endpoints) {
        if (!n.ep) continue;
        expect(X, n.ep, n.port, "TCP", true);
        for (const p of NATS_OTHER_PORTS) if (n.ep.pod) expect(X, n.ep, p, "TCP", false);
        if (n.ep.pod) {
          const lookalike = { pod: true, name: `a pod labelled like NATS in another namespace`, namespace: "elsewhere", nsLabels: { "kubernetes.io/metadata.name": "elsewhere" }, labels: { ...NATS_POD_LABELS }, ports: n.ep.ports };
          expect(X, lookalike, n.port, "TCP", false);
        }
        expect(X, internet, n.port, "TCP", false);
        expect(X, { ...strangerPod, ports: [{ name: NATS_CLIENT_PORT_NAME, containerPort: n.port, protocol: "TCP" }] }, n.port, "TCP", false);
      }
    }
    for (const src of [...all.filter((x) => !x.js), ...Js]) {
      for (const n of natsEps.values()) expect(src, n.ep, n.port, "TCP", false);
    }
    for (const J of Js) {
      expect(J, kubeDns, 53, "UDP", true);
      expect(J, kubeDns, 53, "TCP", true);
      expect(J, internet, 443, "TCP", false);
      expect(J, strangerPod, 8080, "TCP", false);
      for (const dst of all) {
        for (const pn of ["grpc", "metrics", "health"]) {
          const port = portOf(dst, pn);
          if (port !== undefined) expect(J, dst, port, "TCP", false);
        }
      }
      for (const src of [strangerPod, foreignPod, outsider, prometheus, ...all]) expect(src, J, 8080, "TCP", false);
    }
    const pgWorkload = workloads.find((w) => w.kind === "StatefulSet");
    if (isProd(name)) {
      check(!pgWorkload, "runs no PostgreSQL of its own (external database)");
      for (const src of [...all, ...Js]) expect(src, externalDb, 5432, "TCP", true);
      for (const J of Js) expect(J, externalDb, 443, "TCP", false);
    } else if (check(pgWorkload, "runs a PostgreSQL StatefulSet")) {
      const PG = podEp(pgWorkload);
      for (const src of [...all, ...Js]) expect(src, PG, 5432, "TCP", true);
      for (const J of Js) expect(J, externalDb, 5432, "TCP", false);
      for (const src of [strangerPod, foreignPod, outsider]) expect(src, PG, 5432, "TCP", false);
      expect(PG, internet, 443, "TCP", false);
      for (const src of all) expect(src, externalDb, 5432, "TCP", false);
    }
  }
  // 6. Monitoring (components/monitoring).
  for (const pm of objs.filter((o) => o.kind === "PodMonitor")) {
    scope = `${name} ${ident(pm)}`;
    const nsSel = pm.spec?.namespaceSelector;
    check(!nsSel || nsSel.any === true || (nsSel.matchNames ?? []).includes(ns), `selects pods of the namespace ${ns}`);
    const eps = pm.spec?.podMetricsEndpoints ?? [];
    check(eps.length > 0, "has podMetricsEndpoints");
    for (const [unitName, f] of Object.entries(found)) {
      const labels = f.workload.spec.template.metadata.labels ?? {};
      if (!check(matchSelector(pm.spec?.selector, labels), `selects the pods of ${unitName}`)) continue;
      for (const ep of eps) {
        const port = (f.container.ports ?? []).find((p) => p.name === ep.port);
        check(port && ep.port === "metrics", `podMetricsEndpoints port "${ep.port}" is ${unitName}'s port "metrics" (--metrics_listen)`);
        check((ep.path ?? "/metrics") === "/metrics", `podMetricsEndpoints path ${ep.path} is /metrics`);
      }
      const jl = pm.spec?.jobLabel;
      check(jl && labels[jl] === unitName, `jobLabel (${jl ?? "unset"}) gives ${unitName}'s series job="${unitName}" (found ${jl ? labels[jl] : "the default namespace/name"}): the alerts tell consumers apart by job`);
    }
  }
  for (const cm of objs.filter((o) => o.kind === "ConfigMap" && o.metadata?.labels?.grafana_dashboard !== undefined)) {
    scope = `${name} ${ident(cm)}`;
    check(cm.metadata.labels.grafana_dashboard === "1", `label grafana_dashboard is "1" (found "${cm.metadata.labels.grafana_dashboard}")`);
    for (const [key, text] of Object.entries(cm.data ?? {})) {
      let d = null;
      try {
        d = JSON.parse(text);
      } catch (e) {
        check(false, `${key} is JSON (${e.message})`);
        continue;
      }
      check(key.endsWith(".json") && d.uid && d.title && Array.isArray(d.panels), `${key} is a Grafana dashboard (a .json key; uid, title, panels)`);
    }
  }

  return { objects: objs.length, schemaOk, jetstream: Object.values(found).filter((f) => f.js).length, deployments: deployments.length, cronJobs: cronJobs.length, policies: policies.length, certificates: objs.filter((o) => o.kind === "Certificate").length };
}

// ---------------------------------------------------------------- CronJobs
// What a reconcile CronJob must be: outboxctl reconcile, enabled (it ships
// so: a failed Job is what OutboxReconcileFailed reports), one run at a time, never retried (a failure is a
// finding, or an unreadable database; the next run checks again), bounded
// in time, hardened like the services, and reading the databases from the
// very Secret keys the relay (outbox) and the billing consumer (inbox) use.
const RECONCILE = {
  name: "outbox-reconcile",
  bin: "outboxctl",
  command: "reconcile",
  // flag -> the service whose OUTBOX_DB it must share.
  databases: { orders_db: { comp: "outbox-relay", subscription: "billing" }, billing_db: { comp: "outbox-consumer", handler: "billing" } },
};
const cronPodTemplate = (cj) => cj?.spec?.jobTemplate?.spec?.template;

// Checks every CronJob of an overlay; returns [{ cronJob, container }] of
// the reconcile ones.
function checkCronJobs(name, objs, cronJobs, found, docker) {
  scope = name;
  check(cronJobs.some((cj) => cj.metadata?.name === RECONCILE.name), `renders the CronJob ${RECONCILE.name}`);
  const out = [];
  for (const cj of cronJobs) {
    scope = `${name} ${ident(cj)}`;
    const js = cj.spec?.jobTemplate?.spec ?? {};
    const tpl = cronPodTemplate(cj) ?? {};
    const spec = tpl.spec ?? {};
    check(cj.spec?.suspend !== true, `suspend is false (the reconciliation ships enabled, deploy/README.md; found ${cj.spec?.suspend})`);
    check(cj.spec?.concurrencyPolicy === "Forbid", `concurrencyPolicy is Forbid (found ${cj.spec?.concurrencyPolicy ?? "Allow, the default"})`);
    for (const k of ["successfulJobsHistoryLimit", "failedJobsHistoryLimit"]) {
      check(Number.isInteger(cj.spec?.[k]) && cj.spec[k] >= 1, `${k} is set and >= 1 (found ${cj.spec?.[k]})`);
    }
    check(js.backoffLimit === 0, `jobTemplate backoffLimit is 0 (found ${js.backoffLimit ?? "6, the default"})`);
    check(Number.isInteger(js.activeDeadlineSeconds) && js.activeDeadlineSeconds > 0, `jobTemplate activeDeadlineSeconds is set (found ${js.activeDeadlineSeconds})`);
    check(spec.restartPolicy === "Never", `restartPolicy is Never (found ${spec.restartPolicy})`);
    check(spec.automountServiceAccountToken === false, "automountServiceAccountToken is false");
    check(spec.enableServiceLinks === false, "enableServiceLinks is false (service link variables would be read as OUTBOX_* flags)");
    check(matchSelector({ matchLabels: { "app.kubernetes.io/name": cj.metadata.name } }, tpl.metadata?.labels ?? {}),
      `its pods carry app.kubernetes.io/name: ${cj.metadata.name} (the NetworkPolicies select them by it)`);
    if (!check((spec.containers ?? []).length === 1, `runs one container (found ${(spec.containers ?? []).length})`)) continue;
    const c = spec.containers[0];
    const uid = containerSecurity(spec, c);
    if (docker) check(docker.uid === null || uid === docker.uid, `container ${c.name}: runAsUser ${uid} equals the image's USER ${docker.uid}`);
    checkResources(c);
    checkImage(c, name);
    check(!c.ports?.length, `container ${c.name}: declares no ports`);
    const { env, sources, missing } = resolveEnv(c, objs);
    for (const m of missing) {
      check(isProd(name) && m.kind === "secret" && !m.rendered, `container ${c.name}: reference to ${m.kind} ${m.name}${m.key ? ` key ${m.key}` : ""} resolves`);
    }
    for (const e of c.env ?? []) {
      if (/PASSWORD|SECRET|TOKEN|^OUTBOX_\w*DB$/.test(e.name)) check(e.valueFrom?.secretKeyRef, `container ${c.name}: ${e.name} comes from a Secret`);
    }
    for (const [k, v] of Object.entries(env)) {
      if (!String(sources[k]).startsWith("secret:")) check(!/:\/\/[^/@\s:]+:[^/@\s]+@/.test(v), `container ${c.name}: ${k} (${sources[k]}) holds no URL with a password`);
    }
    const bin = path.basename(c.command?.[0] ?? "");
    if (cj.metadata.name !== RECONCILE.name) continue;
    check(c.command?.[0] === `/usr/local/bin/${RECONCILE.bin}` && c.command.length === 1, `container ${c.name}: command is ["/usr/local/bin/${RECONCILE.bin}"] (found ${JSON.stringify(c.command)})`);
    const argv = (c.args ?? []).map(String);
    check(argv[0] === RECONCILE.command, `container ${c.name}: the first argument is the command "${RECONCILE.command}" (found ${argv[0]})`);
    out.push({ cronJob: cj, container: c });
    const known = FLAGS[bin];
    if (!check(known, `container ${c.name}: ${bin} is an outbox binary whose --helpfull lists its flags`)) continue;
    for (const [k, v] of Object.entries(env)) {
      if (!k.startsWith("OUTBOX_")) continue;
      const flag = k.slice(7).toLowerCase();
      if (check(known[flag], `container ${c.name}: ${k} (${sources[k]}) is a flag of ${bin} (per ${flagSource[bin]})`)) {
        check(known[flag](v), `container ${c.name}: ${k}="${v}" is a valid --${flag} value`);
      }
    }
    const args = argvOf(c, env).args;
    for (const a of args.slice(1)) {
      const m = /^--?([A-Za-z0-9_]+)(?:=(.*))?$/s.exec(a);
      if (!check(m, `container ${c.name}: argument "${a}" is a --flag=value (${RECONCILE.command} takes no other)`)) continue;
      if (check(known[m[1]], `container ${c.name}: argument --${m[1]} is a flag of ${bin} (per ${flagSource[bin]})`) && m[2] !== undefined) {
        check(known[m[1]](m[2]), `container ${c.name}: --${m[1]}="${m[2]}" is a valid value`);
      }
      if (CREDENTIAL_FLAG.test(m[1])) {
        check(false, `container ${c.name}: --${m[1]} is not a literal argument (a credential: ${envNameForFlag(m[1])} from a secretKeyRef)`);
      }
    }
    const window = parseDuration(effectiveFlag(args, env, "window", "1h").value);
    const grace = parseDuration(effectiveFlag(args, env, "grace", "5m").value);
    check(window > grace && grace >= 0, `container ${c.name}: --window (${window} s) is longer than --grace (${grace} s) (outboxctl refuses it otherwise)`);
    // Each event is compared from --grace after its commit until it leaves
    // --window: at least two runs in that span, so that one missed run (a
    // node drained, startingDeadlineSeconds passed) leaves none unchecked.
    const gap = cronMaxGapSeconds(cj.spec?.schedule);
    if (check(gap !== null, `schedule "${cj.spec?.schedule}" is minutes of every hour (M, M,N, */N or A-B/N, then "* * * *"), which this check reads`)) {
      check(window - grace >= 2 * gap, `--window (${window} s) - --grace (${grace} s) covers two runs of schedule "${cj.spec.schedule}" (${gap} s apart at most)`);
    }
    const sub = effectiveFlag(args, env, "subscription", DEFAULT_SUBSCRIPTION).value || DEFAULT_SUBSCRIPTION;
    check(sub === "billing", `container ${c.name}: --subscription is billing, the subscription whose inbox --billing_db holds (found ${sub})`);
    // The databases: from the Secret keys of the services that own them.
    for (const [flag, owner] of Object.entries(RECONCILE.databases)) {
      const envName = `OUTBOX_${flag.toUpperCase()}`;
      const pwName = envName.replace(/_DB$/, "_PASSWORD");
      check(flagInArgs(args, flag) === undefined || flagInArgs(args, flag) === null, `container ${c.name}: --${flag} is not a literal argument (it comes from the Secret)`);
      const ref = (c.env ?? []).find((e) => e.name === envName)?.valueFrom?.secretKeyRef;
      if (!check(ref, `container ${c.name}: ${envName} comes from a Secret key`)) continue;
      const svc = Object.values(found).find((f) => f.comp === owner.comp &&
        (owner.subscription === undefined || f.subscription === owner.subscription) && (owner.handler === undefined || f.handler === owner.handler));
      const sref = (svc?.container.env ?? []).find((e) => e.name === "OUTBOX_DB")?.valueFrom?.secretKeyRef;
      if (check(sref, `the ${owner.comp} (${owner.subscription ?? owner.handler}) takes OUTBOX_DB from a Secret key`)) {
        check(sref.name === ref.name && sref.key === ref.key,
          `container ${c.name}: ${envName} is Secret ${ref.name} key ${ref.key}, the one ${svc.workload.metadata.name} reads its database from (${sref.name}/${sref.key})`);
        // Each database's password: the Secret key its owner passes as
        // PGPASSWORD (which would be one for both connections here).
        const spw = (svc.container.env ?? []).find((e) => e.name === "PGPASSWORD")?.valueFrom?.secretKeyRef;
        const pw = (c.env ?? []).find((e) => e.name === pwName)?.valueFrom?.secretKeyRef;
        check(pw && spw && pw.name === spw.name && pw.key === spw.key, `container ${c.name}: ${pwName} is the Secret key ${spw?.name}/${spw?.key} that ${svc.workload.metadata.name} passes as PGPASSWORD`);
      }
      if (!isProd(name)) {
        let u = null;
        try {
          u = new URL(env[envName]);
        } catch {
          u = null;
        }
        const wantDb = owner.handler ? HANDLERS[owner.handler].database : COMPONENTS[owner.comp].database;
        if (check(u && /^postgres(ql)?:$/.test(u.protocol), `container ${c.name}: ${envName} "${env[envName]}" is a postgresql:// URL`)) {
          check(decodeURIComponent(u.pathname.slice(1)) === wantDb, `container ${c.name}: ${envName} names the database ${wantDb}`);
          check(u.password === "", `container ${c.name}: ${envName} carries no password (${pwName} does)`);
          const r = resolveServiceAddress(objs, cj.metadata.namespace ?? "default", `${u.hostname}:${u.port || 5432}`);
          check(r?.workload, `container ${c.name}: ${envName} host ${u.hostname}:${u.port || 5432} is a rendered Service with a backing pod`);
        }
      }
    }
    check(!(c.env ?? []).some((e) => e.name === "PGPASSWORD"), `container ${c.name}: no PGPASSWORD (one for both databases; OUTBOX_ORDERS_PASSWORD and OUTBOX_BILLING_PASSWORD instead)`);
  }
  return out;
}

// The longest wait in seconds between two runs of a schedule that names
// minutes of every hour ("4-59/15 * * * *", "*/10 * * * *", "0,30 * * * *");
// null for any other form.
function cronMaxGapSeconds(schedule) {
  const f = String(schedule ?? "").trim().split(/\s+/);
  if (f.length !== 5 || f.slice(1).some((x) => x !== "*")) return null;
  const minutes = new Set();
  for (const part of f[0].split(",")) {
    const m = /^(\*|(\d+)(?:-(\d+))?)(?:\/(\d+))?$/.exec(part);
    if (!m) return null;
    const from = m[1] === "*" ? 0 : Number(m[2]);
    const to = m[1] === "*" ? 59 : m[3] !== undefined ? Number(m[3]) : m[4] !== undefined ? 59 : from;
    const step = m[4] !== undefined ? Number(m[4]) : 1;
    if (from > to || to > 59 || step < 1) return null;
    for (let x = from; x <= to; x += step) minutes.add(x);
  }
  const sorted = [...minutes].sort((a, b) => a - b);
  let gap = sorted[0] + 60 - sorted[sorted.length - 1];
  for (let i = 1; i < sorted.length; i++) gap = Math.max(gap, sorted[i] - sorted[i - 1]);
  return gap * 60;
}

// The base rendered alone: its CronJobs are enabled (the overlays inherit
// that unless they patch it).
function checkBase(file) {
  scope = "base";
  const objs = parseDocs(readFileSync(file, "utf8"), file);
  const cjs = objs.filter((o) => o.kind === "CronJob");
  check(cjs.some((cj) => cj.metadata?.name === RECONCILE.name), `renders the CronJob ${RECONCILE.name}`);
  for (const cj of cjs) check(cj.spec?.suspend !== true, `${ident(cj)}: suspend is false (found ${cj.spec?.suspend})`);
}

// Per prod overlay: the Secret keys it expects to be created out of band.
const expectedProdSecretKeys = new Map();
const expectedSecretKeys = (name) => {
  if (!expectedProdSecretKeys.has(name)) expectedProdSecretKeys.set(name, []);
  return expectedProdSecretKeys.get(name);
};
const notes = [];
const schema = makeSchemaValidator(path.join(here, "node_modules"));
const docker = readDockerfile();
const summaries = [];
if (baseFile) {
  try {
    checkBase(baseFile);
  } catch (e) {
    failures.push(`base: ${e.stack ?? e}`);
  }
}
for (const o of overlays) {
  const before = passed;
  const beforeFail = failures.length;
  try {
    const s = await validateOverlay(o.name, o.file, schema, docker);
    summaries.push(`  ${o.name}: ${s.objects} objects, ${s.schemaOk}/${s.objects} valid against the schemas (${schema.packages.map((p) => `${p.name} ${p.version}`).join(", ")}; strict), ` +
      `${s.deployments} Deployments${s.jetstream ? ` (${s.jetstream} in JetStream mode)` : ""}, ${s.cronJobs} CronJobs, ${s.certificates} Certificates, ${s.policies} NetworkPolicies; ${passed - before} checks passed, ${failures.length - beforeFail} failed`);
  } catch (e) {
    failures.push(`${o.name}: ${e.stack ?? e}`);
  }
}
for (const f of failures) console.log(`FAIL ${f}`);
for (const n of new Set(notes)) console.log(`note ${n}`);
console.log("deploy validation:");
console.log(`  flags checked against the binaries' --helpfull (${binDir})`);
for (const s of summaries) console.log(s);
for (const [n, keys] of expectedProdSecretKeys) {
  if (keys.length) console.log(`  ${n} expects pre-created Secrets with: ${[...new Set(keys)].sort().join(", ")}`);
}
console.log(`validate: ${passed} passed, ${failures.length} failed`);
process.exit(failures.length === 0 ? 0 : 1);
