// Offline validation of rendered objects against the upstream Kubernetes
// OpenAPI schemas shipped by the npm package kubernetes-models:
//  1. the package's JSON-schema validator (types, required fields, enums);
//  2. a strict pass for unknown fields, which that validator lets through
//     (its schemas allow additional properties): a misspelt
//     `readinesProbe` would otherwise pass unnoticed, the way
//     `kubectl apply --validate=strict` would reject it. The field lists
//     come from the package's TypeScript declarations, generated from the
//     same OpenAPI document.

import { readFileSync, existsSync } from "node:fs";
import { createRequire } from "node:module";
import path from "node:path";
import { pathToFileURL } from "node:url";

export function makeSchemaValidator(nodeModules) {
  const require = createRequire(path.join(nodeModules, "noop.js"));
  const pkgDir = path.dirname(require.resolve("kubernetes-models/package.json"));
  const pkgVersion = JSON.parse(readFileSync(path.join(pkgDir, "package.json"), "utf8")).version;

  // apiVersion -> directory of the package ("v1", "apps/v1",
  // "networking.k8s.io/v1", ...).
  function modelBase(apiVersion, kind) {
    const base = path.join(pkgDir, apiVersion.includes("/") ? apiVersion : apiVersion);
    const file = path.join(base, `${kind}`);
    return existsSync(`${file}.mjs`) ? file : null;
  }

  const modelCache = new Map();
  async function modelClass(apiVersion, kind) {
    const key = `${apiVersion}/${kind}`;
    if (!modelCache.has(key)) {
      const file = modelBase(apiVersion, kind);
      if (!file) {
        modelCache.set(key, null);
      } else {
        const mod = await import(pathToFileURL(`${file}.mjs`).href);
        modelCache.set(key, { cls: mod[kind], dts: `${file}.d.ts` });
      }
    }
    return modelCache.get(key);
  }

  // --- strict unknown-field pass -------------------------------------
  // A parsed declaration file: { interfaces: {IName: {fields: {f: type}}},
  // aliases: {IIoK8s...: IName}, imports: {IIoK8s...: absPath}, types: {}}
  const dtsCache = new Map();
  function parseDts(file) {
    if (dtsCache.has(file)) return dtsCache.get(file);
    const text = readFileSync(file, "utf8");
    const out = { file, interfaces: {}, aliases: {}, imports: {}, typeAliases: new Set() };
    for (const m of text.matchAll(/^import \{ ([^}]+) \} from "([^"]+)";/gm)) {
      const spec = m[2];
      let target;
      if (spec.startsWith(".")) target = path.resolve(path.dirname(file), `${spec}.d.ts`);
      else if (spec.startsWith("@kubernetes-models/base")) target = null;
      else {
        // Bare specifier of a dependency: look where node would.
        const candidates = [path.join(pkgDir, "node_modules", `${spec}.d.ts`), path.join(nodeModules, `${spec}.d.ts`)];
        target = candidates.find((c) => existsSync(c));
        if (!target) throw new Error(`kubernetes-models: cannot find declarations of ${spec}`);
      }
      for (const name of m[1].split(",").map((s) => s.trim())) {
        if (target) out.imports[name] = target;
      }
    }
    for (const m of text.matchAll(/^export \{ ([^}]+) \};/gm)) {
      for (const part of m[1].split(",")) {
        const mm = /^\s*(\S+) as (\S+)\s*$/.exec(part);
        if (mm) out.aliases[mm[2]] = mm[1];
      }
    }
    for (const m of text.matchAll(/^export declare type (\w+) =/gm)) out.typeAliases.add(m[1]);
    const lines = text.split("\n");
    for (let i = 0; i < lines.length; i++) {
      const head = /^export interface (\w+)(?: extends ([\w, ]+))? \{$/.exec(lines[i]);
      if (!head) continue;
      const fields = {};
      if (head[2] && head[2].includes("TypeMeta")) {
        fields.apiVersion = "string";
        fields.kind = "string";
      }
      let j = i + 1;
      let inComment = false;
      for (; j < lines.length && lines[j] !== "}"; j++) {
        const line = lines[j];
        if (/^\s*\/\*\*/.test(line)) inComment = !/\*\/\s*$/.test(line);
        else if (inComment) {
          if (/\*\/\s*$/.test(line)) inComment = false;
        } else {
          const f = /^ {4}"([^"]+)"\??: (.*?);?$/.exec(line);
          if (f) {
            if (f[2] === "{") {
              // A map: `{ [key: string]: T; }` over the next lines.
              const v = /^\s+\[key: string\]: (.*);$/.exec(lines[j + 1] ?? "");
              fields[f[1]] = v ? `{map:${v[1]}}` : "any";
              while (j < lines.length && !/^ {4}\};?$/.test(lines[j])) j++;
            } else {
              fields[f[1]] = f[2];
            }
          }
        }
      }
      out.interfaces[head[1]] = { fields };
      i = j;
    }
    dtsCache.set(file, out);
    return out;
  }

  // Resolves a type expression in `file` to { kind: "object", file, iface }
  // or { kind: "array"|"map", elem } or { kind: "leaf" }.
  function resolveType(file, type) {
    type = type.trim();
    let m = /^Array<(.*)>$/.exec(type);
    if (m) return { kind: "array", elem: { file, type: m[1] } };
    m = /^\{map:(.*)\}$/.exec(type);
    if (m) return { kind: "map", elem: { file, type: m[1] } };
    if (!/^I\w+$/.test(type)) return { kind: "leaf" };
    const dts = parseDts(file);
    if (dts.interfaces[type]) return { kind: "object", file, iface: type };
    if (dts.aliases[type] && dts.interfaces[dts.aliases[type]]) return { kind: "object", file, iface: dts.aliases[type] };
    if (dts.imports[type]) {
      const target = parseDts(dts.imports[type]);
      const local = target.aliases[type] ?? type;
      if (target.interfaces[local]) return { kind: "object", file: target.file, iface: local };
      return { kind: "leaf" }; // a type alias such as Quantity / IntOrString
    }
    return { kind: "leaf" };
  }

  function unknownFields(value, t, at, errors) {
    if (value === null || value === undefined) return;
    if (t.kind === "array") {
      if (!Array.isArray(value)) return;
      value.forEach((v, i) => unknownFields(v, resolveType(t.elem.file, t.elem.type), `${at}[${i}]`, errors));
    } else if (t.kind === "map") {
      if (typeof value !== "object" || Array.isArray(value)) return;
      for (const [k, v] of Object.entries(value)) unknownFields(v, resolveType(t.elem.file, t.elem.type), `${at}.${k}`, errors);
    } else if (t.kind === "object") {
      if (typeof value !== "object" || Array.isArray(value)) return;
      const { fields } = parseDts(t.file).interfaces[t.iface];
      for (const [k, v] of Object.entries(value)) {
        if (!Object.prototype.hasOwnProperty.call(fields, k)) {
          errors.push(`${at ? at + "." : ""}${k}: unknown field (not in ${t.iface.replace(/^I/, "")})`);
          continue;
        }
        unknownFields(v, resolveType(t.file, fields[k]), at ? `${at}.${k}` : k, errors);
      }
    }
  }

  // Validates one object; returns a list of error strings (empty if valid).
  async function validate(obj) {
    if (!obj || typeof obj !== "object") return ["not an object"];
    const { apiVersion, kind } = obj;
    if (typeof apiVersion !== "string" || typeof kind !== "string") return ["apiVersion and kind are required"];
    const model = await modelClass(apiVersion, kind);
    if (!model || typeof model.cls !== "function") {
      return [`${apiVersion} ${kind}: not a known upstream Kubernetes kind (kubernetes-models ${pkgVersion})`];
    }
    const errors = [];
    try {
      new model.cls(obj).validate();
    } catch (e) {
      const details = Array.isArray(e.errors)
        ? e.errors.map((x) => `${x.instancePath || "/"}: ${x.message}`)
        : [String(e.message ?? e)];
      errors.push(...details);
    }
    unknownFields(obj, { kind: "object", file: model.dts, iface: `I${kind}` }, "", errors);
    return errors;
  }

  return { validate, version: pkgVersion };
}
