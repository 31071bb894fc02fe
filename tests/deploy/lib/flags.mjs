// The flags an outbox binary accepts, read from its own `--helpfull`
// (abseil), so that the manifests are checked against the binary they will
// run rather than against a list kept by hand. Used by validate.mjs and
// rendered.mjs.

import { spawnSync } from "node:child_process";
import { createHash } from "node:crypto";
import { existsSync, mkdirSync, readFileSync, renameSync, statSync, writeFileSync } from "node:fs";
import path from "node:path";

// `BIN --helpfull`'s output. With OUTBOX_HELPFULL_CACHE set (a directory),
// kept there by the binary's path, size and mtime: validate_selftest.sh
// runs the validator over a hundred times against the same binaries.
function helpfullText(bin) {
  const dir = process.env.OUTBOX_HELPFULL_CACHE;
  let file = null;
  if (dir) {
    try {
      const st = statSync(bin);
      const key = createHash("sha256").update(`${path.resolve(bin)}\0${st.size}\0${st.mtimeMs}`).digest("hex");
      file = path.join(dir, key);
      if (existsSync(file)) return readFileSync(file, "utf8");
    } catch {
      file = null;  // no such binary: run it below, which says so
    }
  }
  const r = spawnSync(bin, ["--helpfull"], { encoding: "utf8", timeout: 10000, env: { PATH: process.env.PATH ?? "/usr/bin:/bin" } });
  const text = `${r.stdout ?? ""}${r.stderr ?? ""}`;
  if (file && r.error === undefined && r.signal === null) {
    // Written whole, then renamed: validators run side by side.
    mkdirSync(dir, { recursive: true });
    const tmp = `${file}.${process.pid}`;
    writeFileSync(tmp, text);
    renameSync(tmp, file);
  }
  return text;
}

// Runs `BIN --helpfull` (the exit status is not looked at) and returns
// Map(flag name -> { dflt, help }): the default as printed (e.g.
// '"127.0.0.1:50051"', '10s', 'true', '8', '') and the description, on one
// line; or null when the binary printed no flags (or does not run).
export function helpfull(bin) {
  const text = helpfullText(bin);
  const flags = new Map();
  // Each flag starts on a line "    --name (description...); default: X;"
  // that may wrap onto lines indented deeper.
  const entries = text.split(/\n(?= {4}--[A-Za-z0-9_]+ \()/);
  for (const e of entries) {
    const m = /(?:^|\n) {4}--([A-Za-z0-9_]+) \(/.exec(e);
    if (!m) continue;
    const body = e.slice(m.index).split(/\n(?=\S| {0,3}\S)/)[0].replace(/\s*\n\s*/g, " ").trim();
    const d = /^--[A-Za-z0-9_]+ \((.*)\); default: (.*?);$/.exec(body);
    flags.set(m[1], d ? { dflt: d[2], help: d[1] } : { dflt: "", help: "" });
  }
  return flags.size > 0 ? flags : null;
}

// Map(flag name -> default as printed), or null (see helpfull).
export function helpfullFlags(bin) {
  const h = helpfull(bin);
  return h ? new Map([...h].map(([name, f]) => [name, f.dflt])) : null;
}

// abseil's own flags, present in every binary and of no use in manifests.
export const ABSL_FLAGS = new Set(["flagfile", "fromenv", "tryfromenv", "undefok"]);
