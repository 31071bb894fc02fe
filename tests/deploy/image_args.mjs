#!/usr/bin/env node
// The `podman run` options of every outbox container of a rendered overlay
// (lib/podman.mjs: securityContext, emptyDir volumes, limits), one file per
// Deployment and CronJob in --out (OUT/<name>.args, one option a line), and
// OUT/<binary>.args for calls that name no pod (the first workload running
// that binary; outboxctl: the reconcile CronJob's). Used by run_image.sh,
// whose container wrappers (lib/in_container.sh) read them.
//
//   node image_args.mjs --rendered=FILE --out=DIR
//
// Exit 1 if a field cannot be mapped, if a container's command is not an
// absolute path (the image runs without a shell), or if no outbox
// container is rendered.

import { readFileSync, writeFileSync, mkdirSync, existsSync } from "node:fs";
import path from "node:path";
import { parseDocs, podSpecOf } from "./lib/k8s.mjs";
import { podmanRunArgs } from "./lib/podman.mjs";

const opts = Object.fromEntries(process.argv.slice(2).map((a) => /^--([\w-]+)=(.*)$/s.exec(a)?.slice(1) ?? [a, ""]));
if (!opts.rendered || !opts.out) {
  console.error("usage: image_args.mjs --rendered=FILE --out=DIR");
  process.exit(2);
}
const objs = parseDocs(readFileSync(opts.rendered, "utf8"), opts.rendered);
mkdirSync(opts.out, { recursive: true });
let bad = 0;
let n = 0;
const workloads = [
  ...objs.filter((o) => o.kind === "Deployment").map((o) => ({ name: o.metadata.name, spec: podSpecOf(o) })),
  ...objs.filter((o) => o.kind === "CronJob").map((o) => ({ name: o.metadata.name, spec: o.spec?.jobTemplate?.spec?.template?.spec })),
];
for (const w of workloads) {
  for (const c of w.spec?.containers ?? []) {
    const bin = path.basename(c.command?.[0] ?? "");
    if (!/^outbox/.test(bin)) continue;
    n++;
    if (!path.isAbsolute(c.command[0])) {
      console.log(`FAIL ${w.name}/${c.name}: command ${c.command[0]} is not an absolute path`);
      bad++;
    }
    const { args, unsupported } = podmanRunArgs(w.spec, c);
    for (const u of unsupported) {
      console.log(`FAIL ${w.name}/${c.name}: ${u} has no podman equivalent in tests/deploy/lib/podman.mjs`);
      bad++;
    }
    const text = `${args.join("\n")}\n`;
    writeFileSync(path.join(opts.out, `${w.name}.args`), text);
    const byBin = path.join(opts.out, `${bin}.args`);
    if (bin === "outboxctl") {
      // outboxctl's other calls (load, verify, stats, requeue) run as the
      // CronJob's container does, plus the group of the Secret files
      // (the Deployments' fsGroup) to read the operators' certificate, as
      // a Job of theirs mounting it would.
      const fsGroup = workloads.map((x) => x.spec?.securityContext?.fsGroup).find((g) => Number.isInteger(g));
      const extra = fsGroup !== undefined && !args.includes(`--group-add=${fsGroup}`) ? [`--group-add=${fsGroup}`] : [];
      writeFileSync(byBin, `${[...args, ...extra].join("\n")}\n`);
      if (extra.length) console.log(`note outboxctl outside ${w.name}: ${extra[0]} (the Secret files' group) to read the operators' certificate`);
    } else if (!existsSync(byBin)) {
      writeFileSync(byBin, text);
    }
    console.log(`note ${w.name}/${c.name} (${c.image}): podman run ${args.join(" ")} --entrypoint=${c.command[0]}`);
  }
}
if (n === 0) {
  console.log("FAIL no outbox container in the rendered workloads");
  bad++;
}
process.exit(bad ? 1 : 0);
