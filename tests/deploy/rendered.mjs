#!/usr/bin/env node
// Runs the containers of a rendered overlay as local processes, the way the
// kubelet would start them, and checks them as Kubernetes would.
// Called by tests/deploy/run_rendered.sh, which renders the overlay.
//
//   node rendered.mjs --rendered=FILE --bin=DIR --pg=URL --root=DIR --tmp=DIR
//                     [--replicas=N] [--components=producer,relay,consumer]
//
// For each outbox container of every Deployment: the command, args and
// environment (ConfigMap/Secret references resolved from the rendered
// objects) are taken as rendered, with only these rewrites, since the
// processes share one host:
//  - a PostgreSQL URL gets the test server's host, port and user, and a
//    database name unique to this run (created here, dropped at the end);
//  - an address bound on all interfaces (0.0.0.0:P) becomes 127.0.0.1 on a
//    free port, one per instance and container port;
//  - an address naming a rendered Service (outbox-consumer:50053) becomes
//    localhost and the local port of the pod behind it (the relay checks
//    the consumer's certificate against that name: the rendered name must
//    be in the certificate, and localhost is added locally if it is not);
//  - a path under a Secret volume's mountPath (/etc/outbox/tls/tls.crt)
//    becomes the same file of a local copy of that volume, laid out as the
//    kubelet does (..data symlink swap), holding REAL certificates that
//    lib/certmanager.mjs issues with openssl from the rendered cert-manager
//    Certificates and Issuers (CA chain, SPIFFE URI SANs, DNS names,
//    usages, key algorithm).
// Then: every OUTBOX_* variable and every --flag must be a flag of the
// binary; each instance must report SERVING on its gRPC probe port (the
// plaintext --health_listen port) within its startupProbe budget (a binary
// that exits, e.g. on an unknown flag, fails); the --listen port must refuse
// plaintext when TLS is on; /metrics must answer on the annotated port; logs
// must be JSON when the manifests ask for JSON; reflection must list the
// health service (over mutual TLS with the outboxctl certificate); for every
// subscription (a relay Deployment's --subscription, delivered to the
// consumer Deployment its --consumer reaches) an order created through the
// producer must reach that consumer's inbox through the relay, and after a
// load run by outboxctl every event must have arrived exactly once, in
// order (billing: outboxctl verify; audit: audit_log holds every outbox
// event once); the identities must be admitted and refused as the flags say
// (outboxctl may read stats and requeue on each relay, another service's
// certificate may not read a relay or a consumer); the reconcile CronJob's
// outboxctl command, as rendered, must exit 0 after the load (and with
// --grace=0s, which compares the events just loaded); every consumer must
// serve its renewed certificate without a restart; and after SIGTERM each
// process must exit 0 within its grace period.

import { spawn, spawnSync } from "node:child_process";
import { readFileSync, writeFileSync, appendFileSync, openSync, existsSync, mkdirSync, symlinkSync } from "node:fs";
import http from "node:http";
import http2 from "node:http2";
import net from "node:net";
import path from "node:path";
import {
  parseDocs, resolveEnv, argvOf, parseHostPort, WILDCARD_HOSTS, effectiveFlag, resolveServiceAddress, podSpecOf,
} from "./lib/k8s.mjs";
import { helpfullFlags } from "./lib/flags.mjs";
import { makeCertManager } from "./lib/certmanager.mjs";

const opts = {};
for (const a of process.argv.slice(2)) {
  const m = /^--([\w-]+)=(.*)$/s.exec(a);
  if (!m) {
    console.error(`rendered.mjs: bad argument ${a}`);
    process.exit(2);
  }
  opts[m[1]] = m[2];
}
for (const k of ["rendered", "bin", "pg", "root", "tmp"]) {
  if (!opts[k]) {
    console.error(`rendered.mjs: --${k}= is required`);
    process.exit(2);
  }
}
const replicasOverride = opts.replicas ? Number(opts.replicas) : null;
const only = opts.components ? new Set(opts.components.split(",").map((s) => `outbox-${s.replace(/^outbox-/, "")}`)) : null;
const pidFile = path.join(opts.tmp, "pids");
const buf = path.join(opts.root, "tests/deploy/node_modules/.bin/buf");

let passed = 0;
const failures = [];
function check(cond, what) {
  if (cond) {
    passed++;
    console.log(`ok   ${what}`);
  } else {
    failures.push(what);
    console.log(`FAIL ${what}`);
  }
  return !!cond;
}
const sleep = (ms) => new Promise((r) => setTimeout(r, ms));

// ------------------------------------------------------------- test server
const pgUrl = new URL(opts.pg);
if (!/^postgres(ql)?:$/.test(pgUrl.protocol)) {
  console.error(`rendered.mjs: OUTBOX_TEST_PG_URL must be a postgresql:// URL, got ${opts.pg}`);
  process.exit(2);
}
const runId = `rr${process.pid}_${Date.now().toString(36)}`;
const dbNames = new Map(); // manifest db name -> local db name
function localDb(name) {
  if (!dbNames.has(name)) dbNames.set(name, `${runId}_${name}`.toLowerCase().slice(0, 63));
  return dbNames.get(name);
}
function psql(db, sql) {
  const u = new URL(opts.pg);
  u.pathname = `/${db}`;
  const r = spawnSync("psql", [u.toString(), "-X", "-v", "ON_ERROR_STOP=1", "-At", "-c", sql], {
    encoding: "utf8",
    env: { ...process.env, PGCONNECT_TIMEOUT: "5" },
    timeout: 30000,
  });
  return { ok: r.status === 0, out: (r.stdout ?? "").trim(), err: (r.stderr ?? "").trim() };
}

// ------------------------------------------------------------- ports
// A port free now and not handed out before in this run, below the
// kernel's ephemeral range (32768-60999 by default): a port the kernel
// picked for us there could become some outgoing connection's source port
// before the service under test binds it. 20000-32000, as free_port in
// scripts/lib/common.sh.
const handedOut = new Set();
function freePort(tries = 200) {
  return new Promise((resolve, reject) => {
    const port = 20000 + Math.floor(Math.random() * 12000);
    const again = () =>
      tries > 1 ? resolve(freePort(tries - 1)) : reject(new Error("no free port in 20000-32000"));
    if (handedOut.has(port)) return again();
    const srv = net.createServer();
    srv.once("error", again);
    srv.listen(port, "127.0.0.1", () => {
      srv.close(() => {
        handedOut.add(port);
        resolve(port);
      });
    });
  });
}

// ------------------------------------------------------------- plan
const objs = parseDocs(readFileSync(opts.rendered, "utf8"), opts.rendered);
const ns = objs.find((o) => o.metadata?.namespace)?.metadata.namespace ?? "default";
const deployments = objs.filter((o) => o.kind === "Deployment");

// Instances: one per replica of each Deployment (or --replicas).
const instances = [];
for (const d of deployments) {
  const spec = podSpecOf(d);
  const c = spec.containers.find((x) => path.basename(x.command?.[0] ?? "").startsWith("outbox"));
  if (!c) continue;
  const binName = path.basename(c.command[0]);
  if (only && !only.has(binName)) continue;
  const n = replicasOverride ?? d.spec.replicas ?? 1;
  for (let i = 0; i < n; i++) {
    instances.push({ deployment: d, spec, container: c, binName, name: `${d.metadata.name}-${i}`, ports: new Map() });
  }
}
if (instances.length === 0) {
  console.error("rendered.mjs: no outbox containers in the rendered Deployments");
  process.exit(1);
}
for (const inst of instances) {
  for (const p of inst.container.ports ?? []) inst.ports.set(p.containerPort, await freePort());
}

// ------------------------------------------------------------- certificates
// cert-manager's part: every rendered Certificate issued for real. A
// server whose certificate a rewritten address will dial as "localhost"
// gets that name added locally (noted) if the manifests lack it.
const secretsDir = path.join(opts.tmp, "secrets");
const localNames = [];
const certManager = makeCertManager(objs, secretsDir, {
  extraDnsNames: (c) => {
    const served = (c.spec?.usages ?? []).includes("server auth");
    if (!served || (c.spec?.dnsNames ?? []).includes("localhost")) return [];
    localNames.push(`Certificate ${c.metadata.name}: DNS name localhost added for the local run (the rewritten addresses dial localhost)`);
    return ["localhost"];
  },
  fallbackCa: () => {
    const dir = path.join(opts.tmp, "fallback-ca");
    const r = spawnSync("bash", ["-c", `source "${opts.root}/scripts/lib/certs.sh" && make_ca "${dir}"`], { encoding: "utf8" });
    if (r.status !== 0) throw new Error(`make_ca: ${r.stderr}`);
    return { crt: path.join(dir, "ca.crt"), key: path.join(dir, "ca.key") };
  },
  log: (m) => console.log(`note ${m}`),
  // The kubelet gives Secret files the pod's fsGroup (defaultMode 0440 is
  // then readable by the non-root user); matters when the binaries run as
  // uid 10001 (tests/deploy/emulate_image.sh) and this test as root.
  group: instances.map((i) => i.spec.securityContext?.fsGroup).find((g) => Number.isInteger(g)) ?? null,
});
let certError = null;
try {
  certManager.issueAll();
} catch (e) {
  certError = e.message;
}
// The kubelet's part: each Secret volume of a pod, mounted at a local
// directory (items become symlinks into the Secret's ..data, as the
// kubelet projects them).
function secretVolumeDir(inst, vol) {
  const sec = vol.secret ? { name: vol.secret.secretName, items: vol.secret.items } : null;
  if (!sec) return { error: `volume ${vol.name} is not a Secret volume` };
  const s = certManager.secret(sec.name);
  if (!s) return { error: `Secret ${sec.name} (volume ${vol.name}) is issued by no rendered Certificate` };
  if (!sec.items || sec.items.length === 0) return { dir: s.dir };
  const dir = path.join(opts.tmp, "mounts", inst.name, vol.name);
  mkdirSync(dir, { recursive: true });
  for (const it of sec.items) {
    mkdirSync(path.dirname(path.join(dir, it.path)), { recursive: true });
    symlinkSync(path.join(s.dir, "..data", it.key), path.join(dir, it.path));
  }
  return { dir };
}
for (const inst of instances) {
  inst.mounts = []; // [{ mountPath, dir }]
  for (const m of inst.container.volumeMounts ?? []) {
    const vol = (inst.spec.volumes ?? []).find((v) => v.name === m.name);
    if (!vol?.secret) continue;
    check(m.readOnly === true, `${inst.name}: Secret volume ${m.name} is mounted read-only at ${m.mountPath}`);
    const r = secretVolumeDir(inst, vol);
    if (check(!r.error, `${inst.name}: Secret volume ${m.name} at ${m.mountPath} has a local copy${r.error ? `: ${r.error}` : ""}`)) {
      inst.mounts.push({ mountPath: m.mountPath.replace(/\/$/, ""), dir: r.dir });
    }
  }
  inst.mounts.sort((a, b) => b.mountPath.length - a.mountPath.length);
}

// Rewrites one value (a flag value or an environment value).
const rewriteNotes = [];
function rewrite(inst, value, where) {
  const mount = inst.mounts.find((m) => value.startsWith(`${m.mountPath}/`));
  if (mount) return path.join(mount.dir, value.slice(mount.mountPath.length + 1));
  if (/^postgres(ql)?:\/\//.test(value)) {
    const u = new URL(value);
    const db = decodeURIComponent(u.pathname.slice(1));
    u.hostname = pgUrl.hostname;
    u.port = pgUrl.port;
    u.username = pgUrl.username;
    u.password = "";
    u.pathname = `/${localDb(db)}`;
    for (const [k, v] of pgUrl.searchParams) u.searchParams.set(k, v);
    return u.toString();
  }
  const hp = parseHostPort(value);
  if (!hp) return value;
  if (WILDCARD_HOSTS.has(hp.host)) {
    const local = inst.ports.get(hp.port);
    if (local === undefined) {
      check(false, `${inst.name}: ${where} binds port ${hp.port}, which the container does not declare`);
      return value;
    }
    return `127.0.0.1:${local}`;
  }
  const r = resolveServiceAddress(objs, ns, value);
  if (r) {
    if (!r.workload) {
      check(false, `${inst.name}: ${where} "${value}" names Service ${r.service.metadata.name} but no pod port behind it`);
      return value;
    }
    const target = instances.find((x) => x.deployment === r.workload);
    if (!target) {
      rewriteNotes.push(`${inst.name}: ${where} "${value}" points at ${r.workload.metadata.name}, which this run does not start`);
      return value;
    }
    // A TLS client checks the server's certificate against the host it
    // dials: the rendered host must be a DNS name of the certificate the
    // target serves (from the rendered Certificate), and the local run
    // dials localhost, which that certificate holds here.
    const served = servedCertificate(target);
    if (served) {
      const host = parseHostPort(value).host;
      check((served.spec?.dnsNames ?? []).includes(host),
        `${inst.name}: ${where} host "${host}" is a DNS name of Certificate ${served.metadata.name}, which ${target.deployment.metadata.name} serves (${(served.spec?.dnsNames ?? []).join(", ")})`);
    }
    return `localhost:${target.ports.get(r.containerPort)}`;
  }
  return value;
}

const emulateMounts = () => [secretsDir, path.join(opts.tmp, "mounts")].filter((d) => existsSync(d)).join(":");

// The Certificate behind an instance's --tls_cert (from its Secret volume).
function servedCertificate(inst) {
  const { env } = resolveEnv(inst.container, objs);
  const { args } = argvOf(inst.container, env);
  const file = effectiveFlag(args, env, "tls_cert", "").value;
  if (!file) return null;
  for (const m of inst.container.volumeMounts ?? []) {
    if (!file.startsWith(`${m.mountPath.replace(/\/$/, "")}/`)) continue;
    const vol = (inst.spec.volumes ?? []).find((v) => v.name === m.name);
    if (vol?.secret) return certManager.certOfSecret(vol.secret.secretName);
  }
  return null;
}
if (certError) check(false, `cert-manager's part: the rendered Certificates are issued: ${certError}`);
for (const n of localNames) console.log(`note ${n}`);

for (const inst of instances) {
  const { env, missing } = resolveEnv(inst.container, objs);
  for (const m of missing) check(false, `${inst.name}: ${m.kind} ${m.name}${m.key ? ` key ${m.key}` : ""} is rendered`);
  const { command, args } = argvOf(inst.container, env);
  inst.manifestEnv = env;
  inst.manifestArgs = args;
  inst.bin = path.join(opts.bin, path.basename(command[0]));
  inst.argv = [...command.slice(1), ...args].map((a) => {
    const m = /^(--?[\w-]+=)(.*)$/s.exec(a);
    return m ? m[1] + rewrite(inst, m[2], m[1].replace(/=$/, "")) : rewrite(inst, a, "argument");
  });
  inst.env = {};
  for (const [k, v] of Object.entries(env)) inst.env[k] = rewrite(inst, v, k);
  if (pgUrl.password) inst.env.PGPASSWORD = decodeURIComponent(pgUrl.password);
  // What a container has besides its declared environment.
  inst.env.PATH = "/usr/local/bin:/usr/local/sbin:/usr/sbin:/usr/bin:/sbin:/bin";
  inst.env.HOSTNAME = inst.name;
  inst.env.HOME = "/nonexistent";
  // Read only by the wrappers of tests/deploy/emulate_image.sh (which show
  // these directories inside their read-only image root, and hide the
  // variable from the binary): the local copies of the Secret volumes.
  if (inst.mounts.length) inst.env.EMULATE_IMAGE_MOUNTS = emulateMounts();
  const probe = inst.container.readinessProbe?.grpc?.port;
  inst.probePort = inst.ports.get(probe);
  const listen = parseHostPort(effectiveFlag(args, env, "listen", "").value);
  inst.apiPort = listen ? inst.ports.get(listen.port) : undefined;
  inst.tls = effectiveFlag(args, env, "tls_cert", "").value !== "";
  const mport = Number(inst.deployment.spec.template.metadata.annotations?.["prometheus.io/port"]);
  inst.metricsPort = inst.ports.get(mport);
  inst.metricsPath = inst.deployment.spec.template.metadata.annotations?.["prometheus.io/path"] ?? "/metrics";
  const sp = inst.container.startupProbe ?? {};
  inst.startupBudget = Math.min(120, (sp.initialDelaySeconds ?? 0) + (sp.periodSeconds ?? 10) * (sp.failureThreshold ?? 3));
  inst.grace = (inst.spec.terminationGracePeriodSeconds ?? 30) - (inst.container.lifecycle?.preStop?.sleep?.seconds ?? 0);
  inst.logFormat = effectiveFlag(args, env, "log_format", "text").value;
}
// The reconcile CronJob (outboxctl reconcile): its command, arguments and
// environment, with the database URLs rewritten like the services' (the
// same local databases), run once after the load.
const reconcileJobs = [];
for (const cj of objs.filter((o) => o.kind === "CronJob")) {
  const c = cj.spec?.jobTemplate?.spec?.template?.spec?.containers?.[0];
  if (!c || path.basename(c.command?.[0] ?? "") !== "outboxctl") continue;
  const job = { name: cj.metadata.name, mounts: [], ports: new Map() };
  const { env, missing } = resolveEnv(c, objs);
  for (const m of missing) check(false, `${job.name}: ${m.kind} ${m.name}${m.key ? ` key ${m.key}` : ""} is rendered`);
  const { command, args } = argvOf(c, env);
  job.bin = path.join(opts.bin, path.basename(command[0]));
  job.argv = [...command.slice(1), ...args].map((a) => {
    const m = /^(--?[\w-]+=)(.*)$/s.exec(a);
    return m ? m[1] + rewrite(job, m[2], m[1].replace(/=$/, "")) : a;
  });
  job.env = {};
  for (const [k, v] of Object.entries(env)) job.env[k] = rewrite(job, v, k);
  // The local PostgreSQL's password for each database (one role here).
  for (const k of ["PGPASSWORD", "OUTBOX_ORDERS_PASSWORD", "OUTBOX_BILLING_PASSWORD"]) delete job.env[k];
  if (pgUrl.password) {
    job.env.OUTBOX_ORDERS_PASSWORD = decodeURIComponent(pgUrl.password);
    job.env.OUTBOX_BILLING_PASSWORD = decodeURIComponent(pgUrl.password);
  }
  job.env.PATH = "/usr/local/bin:/usr/local/sbin:/usr/sbin:/usr/bin:/sbin:/bin";
  job.env.HOME = "/nonexistent";
  job.deadline = cj.spec?.jobTemplate?.spec?.activeDeadlineSeconds ?? 120;
  reconcileJobs.push(job);
}
for (const n of rewriteNotes) console.log(`note ${n}`);

// ------------------------------------------------------------- checks
function flagsOf(bin) {
  return new Set((helpfullFlags(bin) ?? new Map()).keys());
}

// The client identities of this run: the certificate Secret of each
// rendered Certificate by its URI SAN (spiffe://outbox/outboxctl, ...).
function identity(uri) {
  const c = certManager.certs.find((x) => (x.spec?.uris ?? []).includes(uri));
  const s = c && certManager.secret(c.spec.secretName);
  return s ? { ca: s.path("ca.crt"), cert: s.path("tls.crt"), key: s.path("tls.key"), uri } : null;
}

// grpc.health.v1.Health/Check for service "" over h2c, as the kubelet's
// grpc probe does. Resolves to "SERVING", "NOT_SERVING", "UNKNOWN", or an
// error text.
function healthCheck(port, timeoutMs = 2000) {
  return new Promise((resolve) => {
    let done = false;
    const finish = (v) => {
      if (!done) {
        done = true;
        try {
          client.close();
        } catch {}
        resolve(v);
      }
    };
    const client = http2.connect(`http://127.0.0.1:${port}`);
    client.on("error", (e) => finish(`error: ${e.code ?? e.message}`));
    client.setTimeout(timeoutMs, () => finish("error: timeout"));
    const req = client.request({
      ":method": "POST",
      ":path": "/grpc.health.v1.Health/Check",
      "content-type": "application/grpc",
      te: "trailers",
    });
    const chunks = [];
    let grpcStatus = null;
    req.on("response", (h) => {
      if (h["grpc-status"] !== undefined) grpcStatus = h["grpc-status"];
    });
    req.on("trailers", (t) => {
      grpcStatus = t["grpc-status"];
    });
    req.on("data", (d) => chunks.push(d));
    req.on("error", (e) => finish(`error: ${e.code ?? e.message}`));
    req.on("end", () => {
      if (grpcStatus !== "0") return finish(`error: grpc-status ${grpcStatus}`);
      const body = Buffer.concat(chunks);
      // 5-byte gRPC frame header, then HealthCheckResponse{status = 1}.
      const msg = body.subarray(5);
      let status = 0;
      if (msg.length >= 2 && msg[0] === 0x08) status = msg[1];
      finish(["UNKNOWN", "SERVING", "NOT_SERVING", "SERVICE_UNKNOWN"][status] ?? `status ${status}`);
    });
    req.end(Buffer.from([0, 0, 0, 0, 0])); // empty request message
  });
}

function httpGet(port, p) {
  return new Promise((resolve) => {
    const req = http.get({ host: "127.0.0.1", port, path: p, timeout: 3000 }, (res) => {
      let body = "";
      res.setEncoding("utf8");
      res.on("data", (d) => (body += d));
      res.on("end", () => resolve({ status: res.statusCode, type: res.headers["content-type"] ?? "", body }));
    });
    req.on("timeout", () => req.destroy(new Error("timeout")));
    req.on("error", (e) => resolve({ status: 0, error: e.message, body: "" }));
  });
}

// buf curl; with `id` (identity()) over mutual TLS to https://localhost,
// otherwise plaintext h2c to 127.0.0.1. `target` is "PORT/service/Method"
// or "PORT" (with --list-methods).
function bufCurl(args, target, id = null, timeoutMs = 15000) {
  const tls = id ? ["--cacert", id.ca, "--cert", id.cert, "--key", id.key] : ["--http2-prior-knowledge"];
  const url = id ? `https://localhost:${target}` : `http://127.0.0.1:${target}`;
  const r = spawnSync(buf, ["curl", "--protocol", "grpc", "--timeout", "10s", ...tls, ...args, url], {
    encoding: "utf8",
    timeout: timeoutMs,
  });
  return { ok: r.status === 0, out: (r.stdout ?? "").trim(), err: (r.stderr ?? "").trim() };
}

function run(cmd, args, env = {}, timeoutMs = 120000) {
  const r = spawnSync(cmd, args, { encoding: "utf8", timeout: timeoutMs, env: { ...process.env, EMULATE_IMAGE_MOUNTS: emulateMounts(), ...env } });
  return { ok: r.status === 0, out: (r.stdout ?? "").trim(), err: `${(r.stderr ?? "").trim()}${r.error ? ` ${r.error.message}` : ""}` };
}

// The serial of the certificate a TLS server presents.
function servedSerial(port, id) {
  const s = spawnSync("openssl", ["s_client", "-connect", `127.0.0.1:${port}`, "-servername", "localhost", "-alpn", "h2",
    "-CAfile", id.ca, "-cert", id.cert, "-key", id.key], { input: "", encoding: "utf8", timeout: 10000 });
  const x = spawnSync("openssl", ["x509", "-noout", "-serial"], { input: s.stdout ?? "", encoding: "utf8", timeout: 10000 });
  return x.status === 0 ? x.stdout.trim() : null;
}

function tail(file, n = 15) {
  try {
    return readFileSync(file, "utf8").trimEnd().split("\n").slice(-n).map((l) => `       ${l}`).join("\n");
  } catch {
    return "";
  }
}

// ------------------------------------------------------------- run
const children = [];
function killAll(signal = "SIGKILL") {
  for (const ch of children) {
    if (ch.exitCode === null && ch.signalCode === null) {
      try {
        process.kill(ch.pid, signal);
      } catch {}
    }
  }
}
function dropDatabases() {
  if (process.env.KEEP_DATABASES === "1") return;
  for (const local of dbNames.values()) {
    psql(pgUrl.pathname.slice(1) || "postgres", `DROP DATABASE IF EXISTS "${local}" WITH (FORCE)`);
  }
  dbNames.clear();
}
process.on("exit", () => killAll());
for (const s of ["SIGINT", "SIGTERM", "SIGHUP"]) {
  process.on(s, () => {
    console.log(`run_rendered: ${s}; stopping what this run started`);
    killAll();
    dropDatabases();
    process.exit(1);
  });
}

async function main() {
  // 1. Flags and variables the binaries know.
  const known = new Map();
  for (const inst of instances) {
    if (!check(existsSync(inst.bin), `${inst.name}: binary ${inst.bin} exists`)) return;
    if (!known.has(inst.bin)) known.set(inst.bin, flagsOf(inst.bin));
    const flags = known.get(inst.bin);
    if (!check(flags.size > 0, `${inst.name}: ${path.basename(inst.bin)} --helpfull lists its flags`)) continue;
    for (const k of Object.keys(inst.manifestEnv).filter((k) => k.startsWith("OUTBOX_"))) {
      const flag = k.slice("OUTBOX_".length).toLowerCase();
      check(flags.has(flag), `${inst.name}: ${k} from the manifests is a flag of ${path.basename(inst.bin)} (--${flag})`);
    }
    for (const a of inst.manifestArgs) {
      const m = /^--?([A-Za-z0-9_]+)/.exec(a);
      if (m) check(flags.has(m[1]) || (m[1].startsWith("no") && flags.has(m[1].slice(2))), `${inst.name}: argument --${m[1]} is a flag of ${path.basename(inst.bin)}`);
    }
  }

  // 2. Databases of this run.
  for (const [orig, local] of dbNames) {
    const r = psql(pgUrl.pathname.slice(1) || "postgres", `CREATE DATABASE "${local}"`);
    if (!check(r.ok, `database ${local} (for ${orig}) created on the test server`)) {
      console.log(`       ${r.err}`);
      return;
    }
    appendFileSync(path.join(opts.tmp, "databases"), `${local}\n`);
  }

  // 3. Start everything at once, as a fresh rollout does (concurrent
  // migrations included).
  for (const inst of instances) {
    inst.log = path.join(opts.tmp, `${inst.name}.log`);
    const fd = openSync(inst.log, "a");
    writeFileSync(path.join(opts.tmp, `${inst.name}.cmd`), `${Object.entries(inst.env).map(([k, v]) => `${k}=${JSON.stringify(k === "PGPASSWORD" ? "***" : v)}`).join(" ")} ${inst.bin} ${inst.argv.join(" ")}\n`);
    console.log(`start ${inst.name}: ${path.basename(inst.bin)} ${inst.argv.join(" ")}`);
    const ch = spawn(inst.bin, inst.argv, { env: inst.env, stdio: ["ignore", fd, fd] });
    ch.startedAt = Date.now();
    inst.child = ch;
    children.push(ch);
    appendFileSync(pidFile, `${ch.pid} ${inst.bin}\n`);
    inst.exited = new Promise((resolve) => ch.on("exit", (code, signal) => resolve({ code, signal, at: Date.now() })));
  }

  // 4. Health SERVING on the probe port within the startup budget.
  await Promise.all(
    instances.map(async (inst) => {
      const deadline = Date.now() + inst.startupBudget * 1000;
      let last = "";
      while (Date.now() < deadline) {
        if (inst.child.exitCode !== null || inst.child.signalCode !== null) break;
        last = await healthCheck(inst.probePort);
        if (last === "SERVING") break;
        await sleep(250);
      }
      inst.up = last === "SERVING";
      const died = inst.child.exitCode !== null || inst.child.signalCode !== null;
      check(inst.up, `${inst.name}: grpc.health.v1 reports SERVING on the probe port (${inst.container.readinessProbe?.grpc?.port} -> 127.0.0.1:${inst.probePort})` +
        (inst.up ? ` after ${((Date.now() - inst.child.startedAt) / 1000).toFixed(1)} s` :
          died ? `: the process exited with ${inst.child.exitCode ?? inst.child.signalCode}` : `: last answer ${last} after ${inst.startupBudget} s`));
      if (!inst.up) console.log(tail(inst.log));
    }),
  );
  const up = instances.filter((i) => i.up);
  // The operators' identity, when the manifests turn TLS on.
  const anyTls = instances.some((i) => i.tls);
  const ctl = anyTls ? identity("spiffe://outbox/outboxctl") : null;
  if (anyTls) check(ctl, "a Certificate with the URI SAN spiffe://outbox/outboxctl is rendered and issued (the operators' client certificate)");

  // 5. Metrics, logs, reflection.
  for (const inst of up) {
    const r = await httpGet(inst.metricsPort, inst.metricsPath);
    const lines = r.body.split("\n").filter((l) => l.trim() !== "");
    const samples = lines.filter((l) => !l.startsWith("#"));
    // Values as Prometheus parses them (Go's ParseFloat: NaN and Inf in any case).
    const malformed = samples.filter((l) => !/^[a-zA-Z_:][a-zA-Z0-9_:]*(\{.*\})? ([-+0-9.eE]+|[Nn][Aa][Nn]|[+-]?[Ii][Nn][Ff])( -?\d+)?$/.test(l));
    check(r.status === 200 && r.type.startsWith("text/plain") && malformed.length === 0,
      `${inst.name}: GET ${inst.metricsPath} on the annotated metrics port (${inst.deployment.spec.template.metadata.annotations?.["prometheus.io/port"]} -> 127.0.0.1:${inst.metricsPort}) answers 200 text/plain in the Prometheus format` +
      ` (status ${r.status}${r.error ? `, ${r.error}` : ""}, ${samples.length} samples${malformed.length ? `, malformed: ${malformed[0].slice(0, 120)}` : ""})`);
    if (r.status === 200 && samples.length === 0) console.log(`note ${inst.name}: /metrics has no samples yet (series appear only once something is counted?)`);
    const ls = bufCurl(["--list-methods"], `${inst.apiPort}`, inst.tls ? ctl : null);
    check(ls.ok && ls.out.includes("grpc.health.v1.Health/Check"), `${inst.name}: reflection on the --listen port${inst.tls ? " (mutual TLS, outboxctl certificate)" : ""} lists grpc.health.v1.Health/Check${ls.ok ? "" : `: ${ls.err.split("\n")[0]}`}`);
    if (inst.tls) {
      const plain = await healthCheck(inst.apiPort);
      check(plain !== "SERVING", `${inst.name}: the --listen port refuses plaintext (answer: ${plain})`);
      const h = bufCurl(["-d", "{}"], `${inst.apiPort}/grpc.health.v1.Health/Check`, ctl);
      check(h.ok && h.out.includes("SERVING"), `${inst.name}: health over mutual TLS on the --listen port answers SERVING${h.ok ? "" : `: ${h.err.split("\n")[0]}`}`);
    }
  }

  // 6. End to end, per subscription: each relay Deployment delivers its
  // --subscription to the consumer Deployment its --consumer reaches (as
  // rendered); an order created through the producer must reach every
  // subscription's consumer.
  const producer = up.find((i) => i.binName === "outbox-producer");
  const subscriptions = [];
  for (const d of [...new Set(instances.filter((i) => i.binName === "outbox-relay").map((i) => i.deployment))]) {
    const first = instances.find((i) => i.deployment === d);
    const name = effectiveFlag(first.manifestArgs, first.manifestEnv, "subscription", "billing").value;
    const target = resolveServiceAddress(objs, ns, effectiveFlag(first.manifestArgs, first.manifestEnv, "consumer", "127.0.0.1:50053").value)?.workload ?? null;
    const cInst = instances.find((i) => i.deployment === target && i.binName === "outbox-consumer");
    const handler = cInst ? effectiveFlag(cInst.manifestArgs, cInst.manifestEnv, "handler", "billing").value : null;
    const cDb = cInst ? effectiveFlag(cInst.manifestArgs, cInst.manifestEnv, "db", "").value : "";
    let db = null;
    try {
      db = localDb(decodeURIComponent(new URL(cDb).pathname.slice(1)));
    } catch {
      db = null;
    }
    subscriptions.push({
      name, handler, db, relayDeployment: d.metadata.name, consumerDeployment: target?.metadata?.name ?? "(none)",
      relays: up.filter((i) => i.deployment === d), consumers: up.filter((i) => i.deployment === target && i.binName === "outbox-consumer"),
    });
  }
  for (const s of subscriptions) console.log(`note subscription ${s.name}: ${s.relayDeployment} -> ${s.consumerDeployment} (--handler=${s.handler}, database ${s.db})`);
  const haveAll = producer && subscriptions.length > 0 && subscriptions.every((s) => s.relays.length > 0 && s.consumers.length > 0 && s.db);
  const orders = [...dbNames.entries()].find(([k]) => k === "outbox_orders")?.[1];
  const count = (db, sql) => {
    const q = psql(db, sql);
    return q.ok ? Number(q.out) : 0;
  };
  const inboxRows = (s) => count(s.db, "SELECT count(*) FROM inbox");
  const waitFor = async (f, ms) => {
    const deadline = Date.now() + ms;
    let v = f();
    while (!v.done && Date.now() < deadline) {
      await sleep(500);
      v = f();
    }
    return v;
  };
  const waitInbox = (s, atLeast, ms) => waitFor(() => {
    const n = inboxRows(s);
    return { done: n >= atLeast, n };
  }, ms).then((v) => v.n);
  const createOrder = (tag) => {
    const order = { customerId: "c1", items: [{ sku: "book", quantity: 2, unitPriceCents: 1250 }], currency: "EUR", idempotencyKey: `${runId}-${tag}` };
    return bufCurl(["--data", JSON.stringify(order)], `${producer.apiPort}/outbox.v1.OrderService/CreateOrder`, producer.tls ? ctl : null);
  };
  const sub = (s) => `subscription ${s.name} (${s.relayDeployment} -> ${s.consumerDeployment})`;
  if (haveAll) {
    const r = createOrder("1");
    const how = producer.tls ? " over mutual TLS (outboxctl certificate)" : "";
    if (check(r.ok, `CreateOrder through the producer${how} succeeds${r.ok ? "" : `: ${r.err.split("\n")[0]}`}`)) {
      for (const s of subscriptions) {
        const n = await waitInbox(s, 1, 30000);
        check(n >= 1, `${sub(s)}: the order's event reached the consumer's inbox through the relay${s.relays[0].tls ? " (relay -> consumer over mutual TLS)" : ""} within 30 s (inbox rows: ${n})`);
      }
    }

    // Load and an end-to-end verification by outboxctl, with the
    // operators' certificate. Without the binary these checks cannot run:
    // that fails, rather than passing with them left out.
    const outboxctl = path.join(opts.bin, "outboxctl");
    const tlsArgs = ctl ? [`--ca=${ctl.ca}`, `--cert=${ctl.cert}`, `--key=${ctl.key}`] : [];
    const dbUrl = (db) => {
      const u = new URL(opts.pg);
      u.pathname = `/${db}`;
      return u.toString();
    };
    const pgEnv = pgUrl.password ? { PGPASSWORD: decodeURIComponent(pgUrl.password) } : {};
    if (existsSync(outboxctl)) {
      const load = run(outboxctl, ["load", ...tlsArgs, `--producer=localhost:${producer.apiPort}`, "--orders=40", "--concurrency=2", "--timeout=5s", `--seed=${process.pid}`]);
      if (check(load.ok, `outboxctl load: 40 orders through the producer${how}${load.ok ? "" : `: ${(load.err || load.out).split("\n").slice(-2).join(" ")}`}`)) {
        for (const s of subscriptions) {
          if (s.handler === "billing") {
            const v = run(outboxctl, ["verify", `--orders_db=${dbUrl(orders)}`, `--billing_db=${dbUrl(s.db)}`, "--wait=60s"], pgEnv, 90000);
            check(v.ok, `${sub(s)}: outboxctl verify: every event delivered exactly once, in order${v.ok ? "" : `: ${(v.out + v.err).split("\n").slice(-3).join(" ")}`}`);
            // Its report, as an operator would read it.
            for (const l of v.out.split("\n").filter((x) => x.trim() !== "")) console.log(`       | ${l}`);
            // The CronJob's command as rendered (exit 0: nothing missing),
            // and again with --grace=0s, so that the events just loaded
            // (younger than the manifest's grace) are compared too.
            for (const job of reconcileJobs) {
              for (const extra of [[], ["--grace=0s"]]) {
                const at = `${job.name}: ${path.basename(job.bin)} ${[...job.argv, ...extra].join(" ").replace(/postgres(ql)?:\/\/\S+/g, "URL")}`;
                const r = run(job.bin, [...job.argv, ...extra], job.env, job.deadline * 1000);
                let rep = null;
                try {
                  rep = JSON.parse(r.out.split("\n").filter((l) => l.startsWith("{")).at(-1) ?? "");
                } catch {
                  rep = null;
                }
                const counted = extra.length ? rep?.events >= 40 && rep?.applied === rep?.events : true;
                check(r.ok && rep?.ok === true && counted,
                  `${at}: exits 0, every event of the window applied${rep ? ` (events ${rep.events}, applied ${rep.applied}, pending ${rep.pending}, lost ${rep.lost})` : ""}${r.ok ? "" : `: ${(r.out + r.err).split("\n").slice(-3).join(" ")}`}`);
              }
            }
          } else if (s.handler === "audit") {
            // Every event of the outbox recorded once in audit_log (its
            // primary key is the event id), each aggregate's events applied
            // in their order (inbox.apply_id follows the applies).
            const ids = (db, sql) => {
              const q = psql(db, sql);
              return q.ok ? q.out : `error: ${q.err}`;
            };
            const v = await waitFor(() => {
              const want = count(orders, "SELECT count(*) FROM outbox");
              const got = count(s.db, "SELECT count(*) FROM audit_log");
              return { done: want > 0 && got >= want, want, got };
            }, 60000);
            const same = ids(orders, "SELECT string_agg(event_id::text, ',' ORDER BY event_id) FROM outbox") ===
              ids(s.db, "SELECT string_agg(event_id::text, ',' ORDER BY event_id) FROM audit_log");
            const disorder = count(s.db, "SELECT count(*) FROM (SELECT seq, lag(seq) OVER (PARTITION BY aggregate_id ORDER BY apply_id) AS prev FROM inbox) x WHERE seq <= prev");
            check(v.done && same && disorder === 0,
              `${sub(s)}: every outbox event recorded exactly once in audit_log, each aggregate's in order (outbox ${v.want}, audit_log ${v.got}, same event ids: ${same}, out of order: ${disorder})`);
          } else {
            check(false, `${sub(s)}: an end-to-end check for the handler ${s.handler} (this test knows billing and audit)`);
          }
        }
      }
      for (const s of subscriptions) {
        const stats = run(outboxctl, ["stats", ...tlsArgs, `--relay=localhost:${s.relays[0].apiPort}`, `--consumer=localhost:${s.consumers[0].apiPort}`]);
        check(stats.ok && /partitions owned/.test(stats.out) && /applied/.test(stats.out) && new RegExp(`subscription ${s.name}\\b`).test(stats.out),
          `${sub(s)}: outboxctl stats reads the relay's admin API (subscription ${s.name}) and the consumer's query API${ctl ? " as spiffe://outbox/outboxctl" : ""}${stats.ok ? "" : `: ${(stats.err || stats.out).split("\n").slice(-2).join(" ")}`}`);
        const rq = run(outboxctl, ["requeue", ...tlsArgs, `--relay=localhost:${s.relays[0].apiPort}`, "--all-dead"]);
        check(rq.ok && /requeued \d+ dead letters/.test(rq.out), `${sub(s)}: outboxctl requeue --all-dead is admitted (RelayAdmin.Requeue, --admin_clients)${rq.ok ? "" : `: ${(rq.err || rq.out).split("\n").slice(-2).join(" ")}`}`);
      }
    } else {
      check(false, `${outboxctl} exists: without it there is no load, verify, stats or requeue through outboxctl`);
    }

    // Identities the manifests do not admit: another service's
    // certificate (same CA) on each relay's admin API and each consumer.
    const other = subscriptions.some((s) => s.relays[0].tls) ? identity("spiffe://outbox/producer") : null;
    if (other) {
      const code = (r) => (r.ok ? "an answer" : /"code":\s*"(\w+)"/.exec(r.out + r.err)?.[1] ?? (r.out + r.err).split("\n")[0]);
      for (const s of subscriptions) {
        const a = bufCurl(["-d", "{}"], `${s.relays[0].apiPort}/outbox.v1.RelayAdmin/GetStats`, other);
        check(code(a) === "permission_denied", `${s.relayDeployment}: the relay's admin API refuses spiffe://outbox/producer (RelayAdmin/GetStats: ${code(a)})`);
        const b = bufCurl(["-d", "{}"], `${s.consumers[0].apiPort}/outbox.v1.BillingQuery/GetStats`, other);
        check(code(b) === "permission_denied", `${s.consumerDeployment}: the consumer refuses spiffe://outbox/producer (BillingQuery/GetStats: ${code(b)})`);
      }
    }

    // Renewal: cert-manager issues a new certificate (new key) for every
    // consumer, the kubelet swaps the Secret volumes' files; each consumer
    // must serve its new one without a restart, and events must keep
    // flowing to every subscription.
    const renewed = subscriptions.map((s) => ({ s, cert: servedCertificate(s.consumers[0]) })).filter((x) => x.cert);
    if (renewed.length && ctl) {
      const before = renewed.map(({ s }) => s.consumers.map((c) => servedSerial(c.apiPort, ctl)));
      for (const secret of new Set(renewed.map(({ cert }) => cert.spec.secretName))) certManager.renew(secret);
      const deadline = Date.now() + 20000;
      let after = before;
      const changed = (k) => after[k].every((x, i) => x && x !== before[k][i]);
      while (Date.now() < deadline) {
        after = renewed.map(({ s }) => s.consumers.map((c) => servedSerial(c.apiPort, ctl)));
        if (renewed.every((_, k) => changed(k))) break;
        await sleep(1000);
      }
      renewed.forEach(({ s, cert }, k) => check(changed(k),
        `${s.consumerDeployment}: a renewed consumer certificate (Certificate ${cert.metadata.name}: new key, Secret files swapped as the kubelet does) is served within 20 s without a restart (serial ${before[k].join(",")} -> ${after[k].join(",")})`));
      const rows = subscriptions.map((s) => inboxRows(s));
      const r2 = createOrder("renewed");
      for (const [k, s] of subscriptions.entries()) {
        const n2 = r2.ok ? await waitInbox(s, rows[k] + 1, 30000) : rows[k];
        check(r2.ok && n2 > rows[k], `${sub(s)}: after the renewal an order still reaches the consumer's inbox (inbox rows ${rows[k]} -> ${n2})`);
      }
    }
  } else if (!only) {
    check(false, `the producer and every subscription's relay and consumer are up for the end-to-end check (${subscriptions.map((s) => `${s.name}: ${s.relays.length} relays, ${s.consumers.length} consumers up`).join("; ") || "no relay"})`);
  }

  // 7. SIGTERM: exit 0 within the grace period (minus the preStop sleep,
  // which the kubelet spends before signalling). All at once, as when the
  // whole overlay is deleted.
  const started = new Map();
  for (const inst of instances) {
    if (inst.child.exitCode === null && inst.child.signalCode === null) {
      started.set(inst, Date.now());
      process.kill(inst.child.pid, "SIGTERM");
    }
  }
  // Observe health after the signal: NOT_SERVING (or the port closing).
  const sawNotServing = new Map();
  const watchers = [...started.keys()].map(async (inst) => {
    while (inst.child.exitCode === null && inst.child.signalCode === null) {
      const h = await healthCheck(inst.probePort, 500);
      if (h === "NOT_SERVING") sawNotServing.set(inst, true);
      await sleep(50);
    }
  });
  for (const [inst, t0] of started) {
    const res = await Promise.race([inst.exited, sleep(inst.grace * 1000).then(() => null)]);
    if (res === null) {
      check(false, `${inst.name}: exits within ${inst.grace} s of SIGTERM (still running; killed)`);
      console.log(tail(inst.log));
      process.kill(inst.child.pid, "SIGKILL");
      continue;
    }
    const secs = ((res.at - t0) / 1000).toFixed(2);
    check(res.code === 0, `${inst.name}: exits with status 0 after SIGTERM (got ${res.code ?? res.signal}) in ${secs} s (grace ${inst.grace} s)`);
    if (res.code !== 0) console.log(tail(inst.log));
    if (inst.up && inst.logFormat === "json") {
      const all = readFileSync(inst.log, "utf8").split("\n").filter((l) => l.trim() !== "");
      // The plaintext call this test makes to a TLS port on purpose (above)
      // makes gRPC core log the failed handshake itself, in its own format,
      // past the binary's logger: only that line is set aside (and noted).
      const provoked = inst.tls ? all.filter((l) => /^E\d{4} [\d:. ]+\d+ ssl_transport_security\.cc:\d+\]\s+Handshake failed .*wrong version number/.test(l)) : [];
      const lines = all.filter((l) => !provoked.includes(l));
      const bad = lines.filter((l) => {
        try {
          return typeof JSON.parse(l) !== "object";
        } catch {
          return true;
        }
      });
      check(lines.length > 0 && bad.length === 0, `${inst.name}: all ${lines.length} log lines are JSON (log_format json from the manifests)${bad.length ? `; first other line: ${bad[0].slice(0, 160)}` : ""}`);
      if (provoked.length) console.log(`note ${inst.name}: gRPC core logged ${provoked.length} line(s) outside the JSON format for the plaintext handshake this test attempted (${provoked[0].slice(0, 120)}...)`);
    }
  }
  await Promise.all(watchers);
  for (const inst of started.keys()) {
    if (!sawNotServing.get(inst)) console.log(`note ${inst.name}: NOT_SERVING was not observed between SIGTERM and exit (it may have been too brief to catch)`);
  }
}

try {
  await main();
} catch (e) {
  check(false, `unexpected error: ${e.stack ?? e}`);
}
killAll();
dropDatabases();
console.log(`run_rendered: ${passed} passed, ${failures.length} failed`);
process.exit(failures.length === 0 ? 0 : 1);
