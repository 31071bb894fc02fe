// Helpers shared by validate.mjs and rendered.mjs: reading rendered
// kustomize output, resolving a container's environment the way the kubelet
// does, and reading the outbox binaries' flags (args win over OUTBOX_* env).

import { createHash } from "node:crypto";
import { existsSync, readFileSync, renameSync, writeFileSync } from "node:fs";
import path from "node:path";
import { isDeepStrictEqual } from "node:util";
import { parseAllDocuments } from "yaml";

export const WORKLOAD_KINDS = new Set(["Deployment", "StatefulSet", "DaemonSet"]);

// Parses a multi-document YAML stream; throws on any YAML error (duplicate
// keys included).
export function parseDocs(text, origin = "input") {
  const cached = parseDocsCached(text);
  if (cached !== null) return cached;
  const out = [];
  for (const doc of parseAllDocuments(text, { uniqueKeys: true })) {
    if (doc.errors.length > 0) {
      throw new Error(`${origin}: YAML error: ${doc.errors[0].message}`);
    }
    const value = doc.toJS();
    if (value !== null && value !== undefined) out.push(value);
  }
  return out;
}

// With OUTBOX_YAML_CACHE set (a directory), each document of a stream is
// kept there as JSON by the hash of its text: validate_selftest.sh renders
// the overlays over a hundred times, each time with one thing changed, and
// parsing YAML was half of the validator's time. Only a stream whose
// documents are separated by plain "---" lines is split (kustomize's
// output); a document is kept only when it parsed without error and JSON
// gives back exactly what YAML did. Anything else, and any error, goes to
// the full parse above, which says what is wrong as it always did. Null:
// not cached.
function parseDocsCached(text) {
  const dir = process.env.OUTBOX_YAML_CACHE;
  if (!dir) return null;
  // A directive, a document end marker or anything but "---" after a
  // document start marker: not split here.
  if (/^(%|\.\.\.|---[^\n])/m.test(text)) return null;
  const out = [];
  for (const chunk of text.split(/^---\n/m)) {
    if (chunk.trim() === "") continue;
    const file = path.join(dir, `${createHash("sha256").update(chunk).digest("hex")}.json`);
    if (existsSync(file)) {
      out.push(JSON.parse(readFileSync(file, "utf8")));
      continue;
    }
    const docs = parseAllDocuments(chunk, { uniqueKeys: true });
    const all = Array.isArray(docs) ? docs : [docs];
    if (all.length !== 1 || all[0].errors.length > 0) return null;
    const value = all[0].toJS();
    if (value === null || value === undefined) return null;
    const json = JSON.stringify(value);
    if (!isDeepStrictEqual(JSON.parse(json), value)) return null;
    // Written whole, then renamed: validators run side by side.
    const tmp = `${file}.${process.pid}`;
    writeFileSync(tmp, json);
    renameSync(tmp, file);
    out.push(value);
  }
  return out;
}

export function ident(obj) {
  return `${obj.kind}/${obj.metadata?.name ?? "?"}`;
}

export function find(objs, kind, name) {
  return objs.find((o) => o.kind === kind && o.metadata?.name === name);
}

export function podSpecOf(obj) {
  return obj?.spec?.template?.spec;
}

export function matchSelector(selector, labels = {}) {
  if (selector === undefined || selector === null) return false;
  for (const [k, v] of Object.entries(selector.matchLabels ?? {})) {
    if (labels[k] !== v) return false;
  }
  for (const e of selector.matchExpressions ?? []) {
    const has = Object.prototype.hasOwnProperty.call(labels, e.key);
    switch (e.operator) {
      case "In":
        if (!has || !e.values.includes(labels[e.key])) return false;
        break;
      case "NotIn":
        if (has && e.values.includes(labels[e.key])) return false;
        break;
      case "Exists":
        if (!has) return false;
        break;
      case "DoesNotExist":
        if (has) return false;
        break;
      default:
        return false;
    }
  }
  return true;
}

// A Service's plain `selector` map (not a LabelSelector).
export function matchServiceSelector(selector, labels = {}) {
  if (!selector || Object.keys(selector).length === 0) return false;
  return Object.entries(selector).every(([k, v]) => labels[k] === v);
}

function decodeSecret(secret) {
  const data = {};
  for (const [k, v] of Object.entries(secret.data ?? {})) {
    data[k] = Buffer.from(v, "base64").toString("utf8");
  }
  for (const [k, v] of Object.entries(secret.stringData ?? {})) data[k] = v;
  return data;
}

// Expands $(VAR) as the kubelet does ($$(VAR) escapes it); unknown
// variables stay as written.
export function expandVars(s, env) {
  return s.replace(/\$\$|\$\(([A-Za-z_][A-Za-z0-9_.-]*)\)/g, (m, name) => {
    if (m === "$$") return "$";
    return Object.prototype.hasOwnProperty.call(env, name) ? env[name] : m;
  });
}

// Resolves a container's environment from the rendered objects. Returns
// { env: {NAME: value}, sources: {NAME: "literal"|"configmap"|"secret"|...},
//   missing: [descriptions of references that did not resolve] }.
// A Secret that is referenced but not rendered (prod: created out of band)
// is reported in `missing` with kind "secret"; the variable is left unset.
export function resolveEnv(container, objs) {
  const env = {};
  const sources = {};
  const missing = [];
  const cm = (name) => find(objs, "ConfigMap", name);
  const sec = (name) => find(objs, "Secret", name);
  for (const from of container.envFrom ?? []) {
    const prefix = from.prefix ?? "";
    if (from.configMapRef) {
      const obj = cm(from.configMapRef.name);
      if (!obj) {
        if (!from.configMapRef.optional) missing.push({ kind: "configmap", name: from.configMapRef.name });
        continue;
      }
      for (const [k, v] of Object.entries(obj.data ?? {})) {
        env[prefix + k] = String(v);
        sources[prefix + k] = `configmap:${from.configMapRef.name}`;
      }
    } else if (from.secretRef) {
      const obj = sec(from.secretRef.name);
      if (!obj) {
        if (!from.secretRef.optional) missing.push({ kind: "secret", name: from.secretRef.name });
        continue;
      }
      for (const [k, v] of Object.entries(decodeSecret(obj))) {
        env[prefix + k] = v;
        sources[prefix + k] = `secret:${from.secretRef.name}`;
      }
    }
  }
  for (const e of container.env ?? []) {
    if (e.valueFrom === undefined) {
      env[e.name] = expandVars(String(e.value ?? ""), env);
      sources[e.name] = "literal";
      continue;
    }
    const vf = e.valueFrom;
    if (vf.configMapKeyRef) {
      const obj = cm(vf.configMapKeyRef.name);
      const v = obj?.data?.[vf.configMapKeyRef.key];
      if (v === undefined) {
        if (!vf.configMapKeyRef.optional) {
          missing.push({ kind: "configmap", name: vf.configMapKeyRef.name, key: vf.configMapKeyRef.key, env: e.name });
        }
        continue;
      }
      env[e.name] = String(v);
      sources[e.name] = `configmap:${vf.configMapKeyRef.name}`;
    } else if (vf.secretKeyRef) {
      const obj = sec(vf.secretKeyRef.name);
      const v = obj ? decodeSecret(obj)[vf.secretKeyRef.key] : undefined;
      if (v === undefined) {
        if (!vf.secretKeyRef.optional) {
          missing.push({ kind: "secret", name: vf.secretKeyRef.name, key: vf.secretKeyRef.key, env: e.name, rendered: !!obj });
        }
        continue;
      }
      env[e.name] = v;
      sources[e.name] = `secret:${vf.secretKeyRef.name}`;
    } else {
      // fieldRef / resourceFieldRef: runtime values.
      sources[e.name] = "runtime";
    }
  }
  return { env, sources, missing };
}

// The container's argv after $(VAR) expansion.
export function argvOf(container, env) {
  const cmd = (container.command ?? []).map((a) => expandVars(String(a), env));
  const args = (container.args ?? []).map((a) => expandVars(String(a), env));
  return { command: cmd, args };
}

// The value of an abseil flag in `args`: --name=value, -name=value or
// --name value; a bool flag may appear bare (--name) or as --noname.
// The last occurrence wins, as in absl::ParseCommandLine.
export function flagInArgs(args, name) {
  let value;
  for (let i = 0; i < args.length; i++) {
    const a = args[i];
    if (a === "--") break;
    const m = /^--?([A-Za-z0-9_]+)(?:=(.*))?$/s.exec(a);
    if (!m) continue;
    if (m[1] === name) {
      if (m[2] !== undefined) value = m[2];
      else if (i + 1 < args.length && !args[i + 1].startsWith("-")) value = args[++i];
      else value = "true";
    } else if (m[1] === `no${name}` && m[2] === undefined) {
      value = "false";
    }
  }
  return value;
}

export function envNameForFlag(flag) {
  return "OUTBOX_" + flag.replace(/-/g, "_").toUpperCase();
}

// Effective value of a flag: command-line flag, else OUTBOX_<FLAG>, else
// the default. Returns { value, source }.
export function effectiveFlag(args, env, name, dflt) {
  const a = flagInArgs(args, name);
  if (a !== undefined) return { value: a, source: "args" };
  const envName = envNameForFlag(name);
  if (Object.prototype.hasOwnProperty.call(env, envName)) return { value: env[envName], source: `env ${envName}` };
  return { value: dflt, source: "default" };
}

// absl::ParseDuration: "10s", "1.5s", "500ms", "1m30s", "2h", "0", "inf".
// Returns seconds (a number), or NaN if the text does not parse.
export function parseDuration(text) {
  if (typeof text !== "string") return NaN;
  let s = text.trim();
  if (s === "0") return 0;
  if (s === "inf" || s === "+inf") return Infinity;
  let sign = 1;
  if (s.startsWith("-")) {
    sign = -1;
    s = s.slice(1);
  } else if (s.startsWith("+")) s = s.slice(1);
  const unit = { ns: 1e-9, us: 1e-6, ms: 1e-3, s: 1, m: 60, h: 3600 };
  const re = /(\d+(?:\.\d*)?|\.\d+)(ns|us|ms|s|m|h)/y;
  let total = 0;
  let pos = 0;
  if (s.length === 0) return NaN;
  while (pos < s.length) {
    re.lastIndex = pos;
    const m = re.exec(s);
    if (!m) return NaN;
    total += parseFloat(m[1]) * unit[m[2]];
    pos = re.lastIndex;
  }
  return sign * total;
}

// "host:port", "[v6]:port", ":port" -> { host, port } (port a number), or
// null if it does not parse.
export function parseHostPort(text) {
  if (typeof text !== "string") return null;
  let m = /^\[([^\]]+)\]:(\d+)$/.exec(text);
  if (m) return { host: m[1], port: Number(m[2]) };
  m = /^([^:]*):(\d+)$/.exec(text);
  if (m) return { host: m[1], port: Number(m[2]) };
  return null;
}

export const WILDCARD_HOSTS = new Set(["0.0.0.0", "::", "", "[::]"]);

// Kubernetes resource quantity -> number (CPU in cores, memory in bytes).
export function parseQuantity(q) {
  const s = String(q).trim();
  const m = /^([+-]?[0-9.]+(?:[eE][+-]?\d+)?)(m|k|M|G|T|P|E|Ki|Mi|Gi|Ti|Pi|Ei)?$/.exec(s);
  if (!m) return NaN;
  const mult = {
    undefined: 1, m: 1e-3, k: 1e3, M: 1e6, G: 1e9, T: 1e12, P: 1e15, E: 1e18,
    Ki: 2 ** 10, Mi: 2 ** 20, Gi: 2 ** 30, Ti: 2 ** 40, Pi: 2 ** 50, Ei: 2 ** 60,
  };
  return parseFloat(m[1]) * mult[m[2]];
}

// Resolves a Service's targetPort (number or name) against a pod spec's
// containers. Returns { container, port } or null.
export function resolveTargetPort(podSpec, targetPort, protocol = "TCP") {
  for (const c of podSpec?.containers ?? []) {
    for (const p of c.ports ?? []) {
      const proto = p.protocol ?? "TCP";
      if (proto !== protocol) continue;
      if (typeof targetPort === "string" && !/^\d+$/.test(targetPort)) {
        if (p.name === targetPort) return { container: c, port: p };
      } else if (Number(targetPort) === p.containerPort) {
        return { container: c, port: p };
      }
    }
  }
  return null;
}

// Workloads (Deployments, StatefulSets) whose pod template labels match a
// Service's selector.
export function workloadsForService(objs, svc) {
  return objs.filter(
    (o) => WORKLOAD_KINDS.has(o.kind) && matchServiceSelector(svc.spec?.selector, o.spec?.template?.metadata?.labels),
  );
}

// Resolves "host:port" as seen from a pod in `namespace`: when host names a
// rendered Service (short name, name.ns, name.ns.svc[.cluster.local]),
// returns { service, servicePort, workload, containerPort }.
export function resolveServiceAddress(objs, namespace, hostPort) {
  const hp = parseHostPort(hostPort);
  if (!hp) return null;
  const parts = hp.host.replace(/\.$/, "").split(".");
  const name = parts[0];
  const ns = parts.length > 1 ? parts[1] : namespace;
  if (parts.length > 2 && parts[2] !== "svc") return null;
  const svc = objs.find(
    (o) => o.kind === "Service" && o.metadata?.name === name && (o.metadata?.namespace ?? namespace) === ns,
  );
  if (!svc) return null;
  const sp = (svc.spec?.ports ?? []).find((p) => p.port === hp.port);
  if (!sp) return { service: svc, servicePort: null };
  const workloads = workloadsForService(objs, svc);
  const tp = sp.targetPort ?? sp.port;
  for (const w of workloads) {
    const r = resolveTargetPort(podSpecOf(w), tp, sp.protocol ?? "TCP");
    if (r) return { service: svc, servicePort: sp, workload: w, container: r.container, containerPort: r.port.containerPort };
  }
  return { service: svc, servicePort: sp, workload: null };
}
