// Offline validation of rendered objects against the upstream Kubernetes
// OpenAPI schemas shipped by the npm package kubernetes-models, the
// cert-manager CRD schemas of @kubernetes-models/cert-manager (Issuer,
// Certificate, ... generated from cert-manager's CRDs) and the
// prometheus-operator ones of @kubernetes-models/prometheus-operator
// (PrometheusRule, PodMonitor, ...: components/monitoring):
//  1. the package's JSON-schema validator (types, required fields, enums);
//  2. a strict pass for unknown fields, which that validator lets through
//     (its schemas allow additional properties): a misspelt
//     `readinesProbe` would otherwise pass unnoticed, the way
//     `kubectl apply --validate=strict` would reject it. The field lists
//     come from the packages' TypeScript declarations, generated from the
//     same OpenAPI document (CRD declarations nest their types inline;
//     parseInlineInterface reads those).

import { readFileSync, existsSync } from "node:fs";
import { createRequire } from "node:module";
import path from "node:path";
import { pathToFileURL } from "node:url";

// The CRD model packages besides kubernetes-models (tests/deploy/package.json
// lists them; `npm ci` there installs them).
export const CRD_PACKAGES = ["@kubernetes-models/cert-manager", "@kubernetes-models/prometheus-operator"];

export function makeSchemaValidator(nodeModules) {
  const require = createRequire(path.join(nodeModules, "noop.js"));
  const pkgDir = path.dirname(require.resolve("kubernetes-models/package.json"));
  const versionOf = (dir) => JSON.parse(readFileSync(path.join(dir, "package.json"), "utf8")).version;
  const pkgVersion = versionOf(pkgDir);
  // [{ name, dir, version, crd }]: kubernetes-models first (upstream
  // kinds), then the CRD packages.
  const packages = [{ name: "kubernetes-models", dir: pkgDir, version: pkgVersion, crd: false }];
  for (const name of CRD_PACKAGES) {
    const dir = path.dirname(require.resolve(`${name}/package.json`));
    packages.push({ name, dir, version: versionOf(dir), crd: true });
  }

  // apiVersion -> directory of a package ("v1", "apps/v1",
  // "networking.k8s.io/v1", "cert-manager.io/v1", ...).
  function modelBase(apiVersion, kind) {
    for (const pkg of packages) {
      const file = path.join(pkg.dir, apiVersion, `${kind}`);
      if (existsSync(`${file}.mjs`) && existsSync(`${file}.d.ts`)) return { file, pkg };
    }
    return null;
  }

  const modelCache = new Map();
  async function modelClass(apiVersion, kind) {
    const key = `${apiVersion}/${kind}`;
    if (!modelCache.has(key)) {
      const found = modelBase(apiVersion, kind);
      if (!found) {
        modelCache.set(key, null);
      } else {
        const mod = await import(pathToFileURL(`${found.file}.mjs`).href);
        modelCache.set(key, { cls: mod[kind], dts: `${found.file}.d.ts`, pkg: found.pkg });
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
    if (t.kind === "inline-array" || t.kind === "inline-map") return unknownInline(value, t, at, errors);
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
    } else if (t.kind === "inline") {
      // A CRD declaration's nested object type.
      if (typeof value !== "object" || Array.isArray(value)) return;
      for (const [k, v] of Object.entries(value)) {
        if (!Object.prototype.hasOwnProperty.call(t.node.fields, k)) {
          errors.push(`${at ? at + "." : ""}${k}: unknown field (not in ${t.where}${at ? `.${at}` : ""})`);
          continue;
        }
        unknownFields(v, fromNode(t.node.fields[k], t), at ? `${at}.${k}` : k, errors);
      }
    }
  }

  // A parsed inline type node (parseInlineInterface) -> the forms above.
  function fromNode(node, parent) {
    switch (node.kind) {
      case "object":
        return { kind: "inline", node, file: parent.file, where: parent.where };
      case "array":
        return { kind: "inline-array", elem: node.elem, file: parent.file, where: parent.where };
      case "map":
        return { kind: "inline-map", elem: node.elem, file: parent.file, where: parent.where };
      case "ref":
        return resolveType(parent.file, node.name);
      default:
        return { kind: "leaf" };
    }
  }
  function unknownInline(value, t, at, errors) {
    if (t.kind === "inline-array") {
      if (!Array.isArray(value)) return;
      value.forEach((v, i) => unknownFields(v, fromNode(t.elem, t), `${at}[${i}]`, errors));
    } else if (t.kind === "inline-map") {
      if (typeof value !== "object" || value === null || Array.isArray(value)) return;
      for (const [k, v] of Object.entries(value)) unknownFields(v, fromNode(t.elem, t), `${at}.${k}`, errors);
    } else {
      unknownFields(value, t, at, errors);
    }
  }

  // Validates one object; returns a list of error strings (empty if valid).
  async function validate(obj) {
    if (!obj || typeof obj !== "object") return ["not an object"];
    const { apiVersion, kind } = obj;
    if (typeof apiVersion !== "string" || typeof kind !== "string") return ["apiVersion and kind are required"];
    const model = await modelClass(apiVersion, kind);
    if (!model || typeof model.cls !== "function") {
      return [`${apiVersion} ${kind}: not a known upstream Kubernetes kind (kubernetes-models ${pkgVersion}) nor a kind of ${packages.filter((p) => p.crd).map((p) => `${p.name} ${p.version}`).join(", ")}`];
    }
    const errors = [];
    try {
      new model.cls(obj).validate();
    } catch (e) {
      const details = Array.isArray(e.errors)
        ? e.errors.map((x) => `${x.instancePath || "/"}: ${x.message}${x.params?.allowedValues ? ` (${x.params.allowedValues.join(", ")})` : ""}`)
        : [String(e.message ?? e)];
      errors.push(...details);
    }
    if (model.pkg.crd) {
      const node = inlineInterface(model.dts, `I${kind}`);
      if (!node) errors.push(`${apiVersion} ${kind}: cannot read the declaration of I${kind} in ${model.dts}`);
      else unknownFields(obj, { kind: "inline", node, file: model.dts, where: kind }, "", errors);
    } else {
      unknownFields(obj, { kind: "object", file: model.dts, iface: `I${kind}` }, "", errors);
    }
    return errors;
  }

  const inlineCache = new Map();
  function inlineInterface(file, iface) {
    const key = `${file}#${iface}`;
    if (!inlineCache.has(key)) inlineCache.set(key, parseInlineInterface(readFileSync(file, "utf8"), iface));
    return inlineCache.get(key);
  }

  // Which package validated objects of this apiVersion/kind (for reports).
  async function packageOf(apiVersion, kind) {
    return (await modelClass(apiVersion, kind))?.pkg ?? null;
  }

  return { validate, version: pkgVersion, packages, packageOf };
}

// Parses `export interface NAME { ... }` of a TypeScript declaration file
// whose member types are written inline (as the CRD packages generate
// them) into a type tree:
//   { kind: "object", fields: { name: node } }   { kind: "map", elem }
//   { kind: "array", elem }   { kind: "ref", name }   { kind: "leaf" }
// Returns null when the interface is not found. Handles object literals,
// index signatures, Array<...>, unions, string literals, parentheses and
// indexed access (IFoo["spec"] is a leaf here: only used in class bodies).
export function parseInlineInterface(text, name) {
  const src = text.replace(/\/\*[\s\S]*?\*\//g, " ").replace(/^\s*\/\/.*$/gm, " ");
  const head = new RegExp(`export interface ${name}(?:\\s+extends\\s+[\\w<>, ]+)?\\s*\\{`).exec(src);
  if (!head) return null;
  // Tokens: strings, identifiers/numbers, punctuation.
  const re = /\s*("(?:[^"\\]|\\.)*"|'(?:[^'\\]|\\.)*'|[A-Za-z_$][\w$.]*|-?\d+(?:\.\d+)?|[{}<>\[\]():;|?,&=])/y;
  let pos = head.index + head[0].length - 1;
  const toks = [];
  let depth = 0;
  while (pos < src.length) {
    re.lastIndex = pos;
    const m = re.exec(src);
    if (!m) throw new Error(`${name}: cannot tokenize declaration near "${src.slice(pos, pos + 40)}"`);
    toks.push(m[1]);
    pos = re.lastIndex;
    if (m[1] === "{") depth++;
    else if (m[1] === "}" && --depth === 0) break;
  }
  let i = 0;
  const peek = () => toks[i];
  const next = () => toks[i++];
  const expect = (t) => {
    if (toks[i] !== t) throw new Error(`${name}: expected "${t}" in declaration, found "${toks[i]}"`);
    i++;
  };
  function parseObject() {
    expect("{");
    const fields = {};
    let index = null;
    while (peek() !== "}") {
      if (peek() === "[") {
        // [key: string]: T;
        next(); next(); expect(":"); next(); expect("]"); expect(":");
        index = parseType();
      } else {
        let key = next();
        if (/^["']/.test(key)) key = JSON.parse(key.startsWith("'") ? `"${key.slice(1, -1)}"` : key);
        if (peek() === "?") next();
        expect(":");
        fields[key] = parseType();
      }
      while (peek() === ";" || peek() === ",") next();
    }
    expect("}");
    if (index && Object.keys(fields).length === 0) return { kind: "map", elem: index };
    return { kind: "object", fields };
  }
  function parsePrimary() {
    const t = peek();
    let node;
    if (t === "{") node = parseObject();
    else if (t === "(") {
      next();
      node = parseType();
      expect(")");
    } else if (t === "Array" && toks[i + 1] === "<") {
      next(); next();
      node = { kind: "array", elem: parseType() };
      expect(">");
    } else {
      next();
      if (/^I[A-Z]\w*$/.test(t)) node = { kind: "ref", name: t };
      else node = { kind: "leaf" };
    }
    // T[] and indexed access T["x"].
    while (peek() === "[") {
      next();
      if (peek() === "]") {
        next();
        node = { kind: "array", elem: node };
      } else {
        while (peek() !== "]") next();
        next();
        node = { kind: "leaf" };
      }
    }
    return node;
  }
  function parseType() {
    if (peek() === "|") next();
    const opts = [parsePrimary()];
    while (peek() === "|" || peek() === "&") {
      next();
      opts.push(parsePrimary());
    }
    if (opts.length === 1) return opts[0];
    // A union of an object type with others (rare): check it only when all
    // object members agree; otherwise leave it unchecked.
    const nonLeaf = opts.filter((o) => o.kind !== "leaf");
    return nonLeaf.length === 1 ? nonLeaf[0] : { kind: "leaf" };
  }
  return parseObject();
}
