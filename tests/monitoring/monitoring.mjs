#!/usr/bin/env node
// Checks of deploy/monitoring (the Grafana dashboard, the PrometheusRule and
// its runbook), for tests/monitoring/rules_test.sh and live_test.sh.
//
//   node monitoring.mjs static  --root=DIR --out=DIR
//       The PrometheusRule validates against the prometheus-operator CRD
//       schema (npm @kubernetes-models/prometheus-operator, strictly, as
//       tests/deploy/validate.mjs validates every rendered object); every
//       alert has a severity, a summary, a description and a runbook_url
//       naming a section of RUNBOOK.md; rules_test.yaml makes every alert
//       fire and shows it quiet; the dashboard's variables, data sources,
//       layout and panels. Writes the rule groups (the PrometheusRule's
//       spec) to OUT/rules.yaml for promtool.
//   node monitoring.mjs names   --root=DIR SCRAPE.prom ...
//       Every metric name in every PromQL expression of the dashboard (its
//       panels and variables) and of the rules is exported by one of the
//       scrapes (histogram _bucket/_sum/_count resolve to their family);
//       every label they match or group by is one of those series' labels
//       or a target label; equality matchers name values the scrapes have.
//   node monitoring.mjs rules   --root=DIR --out=DIR
//       Only writes OUT/rules.yaml (the PrometheusRule's spec).
//   node monitoring.mjs alerts  --root=DIR --prometheus=URL [--active=NAME,...
//       --labels=K=V,...] [--allow=NAME,...] [--timeout=S]
//       Prometheus evaluated every rule without error; each alert of
//       --active becomes active (pending or firing) with those labels, and
//       no other is active but those of --allow.
//   node monitoring.mjs queries --root=DIR --prometheus=URL
//       Runs every dashboard query (variables set to All) and every query
//       of the alerts' annotations against a Prometheus that scrapes the
//       binaries: each must evaluate and return data; every rule
//       expression must evaluate.
//
// The npm packages come from tests/deploy/node_modules (`npm ci` there).
// Exits 0 if everything holds, 1 otherwise (2 on bad usage).

import { readFileSync, writeFileSync } from "node:fs";
import { createRequire } from "node:module";
import path from "node:path";
import { fileURLToPath, pathToFileURL } from "node:url";

const here = path.dirname(fileURLToPath(import.meta.url));
const nodeModules = path.resolve(here, "../deploy/node_modules");
const require = createRequire(path.join(nodeModules, "noop.js"));
const YAML = require("yaml");

const [cmd, ...rest] = process.argv.slice(2);
const opts = {};
const files = [];
for (const a of rest) {
  const m = /^--(\w+)=(.*)$/.exec(a);
  if (m) opts[m[1]] = m[2];
  else files.push(a);
}
const root = path.resolve(opts.root ?? path.join(here, "../.."));
const mon = path.join(root, "deploy/monitoring");
const usage = "usage: monitoring.mjs static --root=DIR --out=DIR | rules --root=DIR --out=DIR | names --root=DIR SCRAPE... | queries --root=DIR --prometheus=URL | alerts --root=DIR --prometheus=URL [--active=NAME,... --labels=K=V,...] [--allow=NAME,...] [--timeout=S]";

let passed = 0;
const failures = [];
function check(cond, what) {
  if (cond) passed++;
  else failures.push(what);
  return !!cond;
}
function finish(title) {
  for (const f of failures) console.log(`FAIL ${f}`);
  console.log(`${title}: ${passed} passed, ${failures.length} failed`);
  process.exit(failures.length === 0 ? 0 : 1);
}

// Labels the scrape adds to every series (the PodMonitor of
// deploy/k8s/components/monitoring: namespace, pod, job = the Deployment's
// name; instance always). Not in the binaries' exposition.
const TARGET_LABELS = new Set(["namespace", "job", "pod", "instance"]);
const SEVERITIES = new Set(["critical", "warning", "info"]);
// Series a rule may read that no outbox binary exports: kube-state-metrics'
// Jobs (OutboxReconcileFailed), with their labels as its documentation
// (docs/metrics/workload/job-metrics.md) lists them. Only rules, never the
// dashboard, whose every query must return data from the binaries.
const KUBE_STATE_METRICS = {
  kube_job_failed: ["namespace", "job_name", "condition"],
  kube_job_owner: ["namespace", "job_name", "owner_kind", "owner_name", "owner_is_controller"],
};
const RUNBOOK_URL = /^https:\/\/\S+\/deploy\/monitoring\/RUNBOOK\.md#([a-z0-9-]+)$/;

function loadRule() {
  const file = path.join(mon, "prometheus-rule.yaml");
  return YAML.parse(readFileSync(file, "utf8"));
}
function loadDashboard() {
  return JSON.parse(readFileSync(path.join(mon, "dashboard.json"), "utf8"));
}
function rulesOf(pr) {
  return (pr?.spec?.groups ?? []).flatMap((g) => (g.rules ?? []).map((r) => ({ group: g.name, ...r })));
}
// Every panel, rows' nested panels included.
function panelsOf(d) {
  return (d.panels ?? []).flatMap((p) => [p, ...(p.panels ?? [])]);
}
// Grafana's variables in a query, replaced by what they expand to with
// "All" selected; intervals by a range that holds several scrapes.
function expand(expr, interval = "1m") {
  return expr
    .replace(/\$__(rate_interval|interval|range)\b|\$\{__(rate_interval|interval|range)\}/g, interval)
    .replace(/\$\{(\w+)(?::\w+)?\}|\$(\w+)/g, ".*");
}
// label_values(SELECTOR, LABEL) of a query variable.
function variableQueries(d) {
  const out = [];
  for (const v of d.templating?.list ?? []) {
    if (v.type !== "query") continue;
    const q = typeof v.query === "string" ? v.query : v.query?.query ?? v.definition;
    const m = /^\s*label_values\((.*),\s*([A-Za-z_]\w*)\s*\)\s*$/s.exec(q ?? "");
    out.push({ name: v.name, query: q, selector: m?.[1], label: m?.[2] });
  }
  return out;
}
// Every PromQL expression: [{ where, expr }].
function expressions(d, pr) {
  const out = [];
  for (const p of panelsOf(d)) {
    for (const t of p.targets ?? []) if (t.expr) out.push({ where: `dashboard panel "${p.title}" ${t.refId}`, expr: t.expr });
  }
  for (const v of variableQueries(d)) if (v.selector) out.push({ where: `dashboard variable $${v.name}`, expr: v.selector, groupLabels: [v.label] });
  for (const r of rulesOf(pr)) {
    out.push({ where: `rule ${r.alert ?? r.record}`, expr: String(r.expr) });
    // Queries in the annotations' templates: printf `QUERY` $labels.x ...
    for (const [k, text] of Object.entries(r.annotations ?? {})) {
      for (const m of String(text).matchAll(/printf\s+`([^`]*)`/g)) {
        out.push({ where: `rule ${r.alert ?? r.record} annotation ${k}`, expr: m[1].replace(/(\w+)="%s"/g, '$1=~".*"') });
      }
    }
  }
  return out;
}

// ---------------------------------------------------------------- PromQL
// A small PromQL reader: enough to find the metric names, label matchers
// and grouping labels of an expression.
const AGGREGATIONS = new Set(["sum", "min", "max", "avg", "group", "stddev", "stdvar", "count", "count_values", "bottomk", "topk", "quantile", "limitk", "limit_ratio"]);
const GROUPING = new Set(["by", "without", "on", "ignoring", "group_left", "group_right"]);
const KEYWORDS = new Set(["and", "or", "unless", "bool", "offset", "inf", "nan", "atan2"]);

function tokenize(src) {
  const toks = [];
  const re = /\s+|("(?:[^"\\]|\\.)*"|'(?:[^'\\]|\\.)*'|`[^`]*`)|(0x[0-9a-fA-F]+|(?:\d+\.?\d*|\.\d+)(?:[eE][+-]?\d+)?[a-zA-Z0-9_]*)|([a-zA-Z_:][a-zA-Z0-9_:]*)|(=~|!~|!=|==|>=|<=|[-+*/%^<>=(){}\[\],:@])/y;
  let pos = 0;
  while (pos < src.length) {
    re.lastIndex = pos;
    const m = re.exec(src);
    if (!m) throw new Error(`cannot read PromQL at "${src.slice(pos, pos + 30)}"`);
    pos = re.lastIndex;
    if (m[1] !== undefined) toks.push({ t: "str", v: unquote(m[1]) });
    else if (m[2] !== undefined) toks.push({ t: "num", v: m[2] });
    else if (m[3] !== undefined) toks.push({ t: "id", v: m[3] });
    else if (m[4] !== undefined) toks.push({ t: "op", v: m[4] });
  }
  return toks;
}
function unquote(s) {
  if (s.startsWith("`")) return s.slice(1, -1);
  return JSON.parse(s.startsWith("'") ? `"${s.slice(1, -1).replace(/\\'/g, "'").replace(/"/g, '\\"')}"` : s);
}
// -> { selectors: [{ name, matchers: [{ label, op, value }] }], grouping: [label] }
function parsePromQL(expr) {
  const toks = tokenize(expr);
  const selectors = [];
  const grouping = [];
  const matchersAt = (i) => {
    // toks[i] is "{"; returns [matchers, index after "}"].
    const ms = [];
    i++;
    while (i < toks.length && toks[i].v !== "}") {
      if (toks[i].v === ",") {
        i++;
        continue;
      }
      const label = toks[i];
      const op = toks[i + 1];
      const value = toks[i + 2];
      if (label?.t !== "id" || op?.t !== "op" || value?.t !== "str") throw new Error(`bad label matcher near "${label?.v} ${op?.v} ${value?.v}"`);
      ms.push({ label: label.v, op: op.v, value: value.v });
      i += 3;
    }
    return [ms, i + 1];
  };
  for (let i = 0; i < toks.length; ) {
    const tk = toks[i];
    const next = toks[i + 1];
    if (tk.t === "op" && tk.v === "[") {
      while (i < toks.length && toks[i].v !== "]") i++;
      i++;
      continue;
    }
    if (tk.t === "id" && GROUPING.has(tk.v)) {
      i++;
      if (toks[i]?.v === "(") {
        for (i++; i < toks.length && toks[i].v !== ")"; i++) if (toks[i].t === "id") grouping.push(toks[i].v);
        i++;
      }
      continue;
    }
    if (tk.t === "id" && (KEYWORDS.has(tk.v.toLowerCase()) || AGGREGATIONS.has(tk.v))) {
      i++;
      continue;
    }
    if (tk.t === "id" && next?.v === "(") {
      i++; // a function
      continue;
    }
    if (tk.t === "id") {
      if (next?.v === "{") {
        const [ms, j] = matchersAt(i + 1);
        selectors.push({ name: tk.v, matchers: ms });
        i = j;
      } else {
        selectors.push({ name: tk.v, matchers: [] });
        i++;
      }
      continue;
    }
    if (tk.t === "op" && tk.v === "{") {
      const [ms, j] = matchersAt(i);
      const nm = ms.find((m) => m.label === "__name__" && m.op === "=");
      selectors.push({ name: nm?.value ?? null, matchers: ms.filter((m) => m.label !== "__name__") });
      i = j;
      continue;
    }
    i++;
  }
  return { selectors, grouping };
}

// ---------------------------------------------------------------- scrapes
// Prometheus text exposition -> { families: { name: type }, samples: { sampleName: [labels] } }
function parseExposition(text, into) {
  for (const line of text.split("\n")) {
    const type = /^# TYPE (\S+) (\S+)/.exec(line);
    if (type) {
      into.families[type[1]] = type[2];
      continue;
    }
    if (line.startsWith("#") || line.trim() === "") continue;
    const m = /^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(.*)\})?\s+\S+/.exec(line);
    if (!m) continue;
    const labels = {};
    for (const l of (m[2] ?? "").matchAll(/([a-zA-Z_]\w*)="((?:[^"\\]|\\.)*)"/g)) labels[l[1]] = l[2];
    (into.samples[m[1]] ??= []).push(labels);
  }
  return into;
}
// The samples a metric name selects: its own, or those of a histogram or
// summary family it is the _bucket/_sum/_count of.
function resolveName(name, scr) {
  if (!scr.samples[name]) return null;
  const m = /^(.*)_(bucket|sum|count)$/.exec(name);
  const family = m && ["histogram", "summary"].includes(scr.families[m[1]]) ? m[1] : name;
  return { samples: scr.samples[name], family };
}

// ---------------------------------------------------------------- static
function slug(heading) {
  // GitHub's anchors: lower case, punctuation dropped, spaces to hyphens.
  return heading.trim().toLowerCase().replace(/[^\p{L}\p{N}\s_-]/gu, "").replace(/\s/g, "-");
}

async function staticChecks() {
  const out = opts.out;
  if (!out) {
    console.error(usage);
    process.exit(2);
  }
  const pr = loadRule();
  // 1. Schema, the way tests/deploy/validate.mjs validates rendered objects.
  const { makeSchemaValidator, CRD_PACKAGES } = await import(pathToFileURL(path.join(root, "tests/deploy/lib/schema.mjs")).href);
  check(CRD_PACKAGES.includes("@kubernetes-models/prometheus-operator"), "tests/deploy/lib/schema.mjs validates prometheus-operator kinds (CRD_PACKAGES)");
  const schema = makeSchemaValidator(nodeModules);
  const errs = await schema.validate(pr);
  for (const e of errs) check(false, `prometheus-rule.yaml: schema: ${e}`);
  const pkg = await schema.packageOf(pr.apiVersion, pr.kind);
  check(errs.length === 0 && pkg?.name === "@kubernetes-models/prometheus-operator",
    `prometheus-rule.yaml validates as ${pr.apiVersion} ${pr.kind} against ${pkg ? `${pkg.name} ${pkg.version}` : "no package"} (strict)`);

  // 2. Alerts: labels, annotations, runbook sections.
  const runbook = readFileSync(path.join(mon, "RUNBOOK.md"), "utf8");
  const anchors = new Set([...runbook.matchAll(/^#{1,6}\s+(.+)$/gm)].map((m) => slug(m[1])));
  const rules = rulesOf(pr);
  const alerts = rules.filter((r) => r.alert);
  check(alerts.length > 0, "the PrometheusRule has alerts");
  const names = new Set();
  for (const a of alerts) {
    const at = `alert ${a.alert}`;
    check(!names.has(a.alert), `${at}: name used once`);
    names.add(a.alert);
    check(SEVERITIES.has(a.labels?.severity), `${at}: label severity is one of ${[...SEVERITIES].join(", ")} (found ${a.labels?.severity})`);
    for (const k of ["summary", "description", "runbook_url"]) check(typeof a.annotations?.[k] === "string" && a.annotations[k].trim() !== "", `${at}: annotation ${k} is set`);
    const m = RUNBOOK_URL.exec(a.annotations?.runbook_url ?? "");
    if (check(m, `${at}: runbook_url points into deploy/monitoring/RUNBOOK.md#SECTION (found ${a.annotations?.runbook_url})`)) {
      check(anchors.has(m[1]), `${at}: RUNBOOK.md has the section #${m[1]}`);
    }
  }
  // 3. The unit tests make every alert fire and show it quiet.
  const tests = YAML.parse(readFileSync(path.join(here, "rules_test.yaml"), "utf8"));
  const cases = (tests.tests ?? []).flatMap((t) => t.alert_rule_test ?? []);
  for (const a of alerts) {
    const mine = cases.filter((c) => c.alertname === a.alert);
    check(mine.some((c) => (c.exp_alerts ?? []).length > 0), `rules_test.yaml makes ${a.alert} fire`);
    check(mine.some((c) => (c.exp_alerts ?? []).length === 0), `rules_test.yaml shows ${a.alert} not firing`);
  }
  for (const c of cases) check(names.has(c.alertname), `rules_test.yaml tests an alert that exists (${c.alertname})`);

  // 4. The dashboard.
  const d = loadDashboard();
  const vars = d.templating?.list ?? [];
  const dsVar = vars.find((v) => v.name === "datasource");
  check(dsVar?.type === "datasource" && dsVar?.query === "prometheus", "dashboard: variable $datasource of type datasource, query prometheus");
  const subVar = variableQueries(d).find((v) => v.name === "subscription");
  check(subVar?.label === "subscription", `dashboard: variable $subscription is label_values(..., subscription) (found ${subVar?.query})`);
  const isDs = (ds) => ds?.uid === "${datasource}" && ds?.type === "prometheus";
  for (const v of vars.filter((x) => x.type === "query")) check(isDs(v.datasource), `dashboard: variable $${v.name} queries \${datasource}`);
  const ids = new Set();
  const panels = panelsOf(d);
  for (const p of panels) {
    const at = `dashboard panel ${p.id} "${p.title}"`;
    check(Number.isInteger(p.id) && !ids.has(p.id), `${at}: unique integer id`);
    ids.add(p.id);
    const g = p.gridPos ?? {};
    check(Number.isInteger(g.x) && Number.isInteger(g.w) && g.x >= 0 && g.w > 0 && g.x + g.w <= 24 && g.h > 0, `${at}: gridPos within the 24 columns`);
    if (p.type === "row" || p.type === "text") continue;
    check(isDs(p.datasource), `${at}: data source \${datasource}`);
    check((p.targets ?? []).length > 0, `${at}: has queries`);
    for (const t of p.targets ?? []) {
      check(isDs(t.datasource) && typeof t.expr === "string" && t.expr.trim() !== "", `${at} ${t.refId}: a PromQL query on \${datasource}`);
      try {
        parsePromQL(expand(t.expr));
      } catch (e) {
        check(false, `${at} ${t.refId}: ${e.message}`);
      }
    }
  }
  // Overlapping panels would hide one another.
  const boxes = panels.filter((p) => p.gridPos);
  for (let i = 0; i < boxes.length; i++) {
    for (let j = i + 1; j < boxes.length; j++) {
      const a = boxes[i].gridPos;
      const b = boxes[j].gridPos;
      const overlap = a.x < b.x + b.w && b.x < a.x + a.w && a.y < b.y + b.h && b.y < a.y + a.h;
      check(!overlap, `dashboard: panels "${boxes[i].title}" and "${boxes[j].title}" do not overlap`);
    }
  }
  // What the dashboard must show (the issue's list).
  const all = panels.flatMap((p) => (p.targets ?? []).map((t) => t.expr ?? "")).join("\n");
  const topics = {
    "delivered rate": /rate\(outbox_relay_delivered_total\b/,
    "applied rate": /rate\(outbox_consumer_events_total\{[^}]*outcome="applied"/,
    "backlog": /outbox_relay_pending_events\b/,
    "oldest pending age": /outbox_relay_oldest_pending_seconds\b/,
    "the backlog per partition": /by \([^)]*\bpartition\b[^)]*\) \(outbox_relay_(pending_events|oldest_pending_seconds)\b/,
    "latency percentiles from histogram buckets": /histogram_quantile\(\s*0\.\d+,\s*sum by \(le\b[^)]*\) \(rate\(\w+_bucket\b/,
    "end-to-end latency": /outbox_consumer_event_latency_seconds_bucket/,
    "dead letters outstanding": /outbox_relay_dead_letters\{/,
    "held events": /outbox_consumer_held_events\b/,
    "oldest held age": /outbox_consumer_oldest_held_seconds\b/,
    "relay partition ownership": /outbox_relay_partitions_owned/,
    "stream state": /outbox_relay_stream_connected/,
    "stream reconnects": /outbox_relay_stream_failures_total/,
    "producer RPC rate": /rate\(outbox_producer_requests_total\{/,
    "producer RPC errors": /code!="OK"/,
    "database failovers": /increase\(outbox_database_failovers_total\b/,
    "database timelines": /outbox_database_timeline\b/,
    "consumer database changes": /outbox_relay_consumer_database_changes_total\b/,
    "heals": /outbox_relay_heals_total\b/,
    "redeliveries by reason": /by \([^)]*\breason\b[^)]*\) \(increase\(outbox_relay_redelivered_total\b/,
    "diverged aggregates": /outbox_relay_diverged_aggregates\b/,
    "delivery paused by the fence": /outbox_relay_paused\b/,
  };
  for (const [topic, re] of Object.entries(topics)) check(re.test(all), `dashboard shows ${topic}`);

  // 5. The rule groups for promtool.
  writeFileSync(path.join(out, "rules.yaml"), YAML.stringify(pr.spec));
  finish("monitoring static checks");
}

// ---------------------------------------------------------------- names
function namesCheck() {
  if (files.length === 0) {
    console.error(usage);
    process.exit(2);
  }
  const scr = { families: {}, samples: {} };
  for (const f of files) parseExposition(readFileSync(f, "utf8"), scr);
  const used = new Set();
  for (const { where, expr, groupLabels } of expressions(loadDashboard(), loadRule())) {
    let parsed;
    try {
      parsed = parsePromQL(expand(expr));
    } catch (e) {
      check(false, `${where}: ${e.message}`);
      continue;
    }
    check(parsed.selectors.length > 0, `${where}: selects some metric`);
    const known = new Set([...TARGET_LABELS, "le"]);
    for (const s of parsed.selectors) {
      if (!check(s.name, `${where}: every selector names its metric`)) continue;
      const ksm = KUBE_STATE_METRICS[s.name];
      if (ksm && check(where.startsWith("rule "), `${where}: ${s.name} (kube-state-metrics) is used by a rule, not the dashboard`)) {
        for (const l of ksm) known.add(l);
        for (const m of s.matchers) check(ksm.includes(m.label), `${where}: ${s.name} has the label ${m.label} (kube-state-metrics: ${ksm.join(", ")})`);
        continue;
      }
      const r = resolveName(s.name, scr);
      if (!check(r, `${where}: ${s.name} is exported by the binaries (not in the scrapes)`)) continue;
      used.add(r.family);
      const labels = new Set(r.samples.flatMap((l) => Object.keys(l)));
      for (const l of labels) known.add(l);
      for (const m of s.matchers) {
        if (TARGET_LABELS.has(m.label)) continue;
        if (!check(labels.has(m.label), `${where}: ${s.name} has the label ${m.label} (it has: ${[...labels].join(", ") || "none"})`)) continue;
        const values = new Set(r.samples.map((l) => l[m.label]));
        if (m.op === "=" && m.value !== "" && !/\.\*/.test(m.value)) {
          check(values.has(m.value), `${where}: ${s.name}{${m.label}="${m.value}"} exists (values: ${[...values].join(", ")})`);
        }
        if (m.op === "=~" && /^[\w|]+$/.test(m.value)) {
          for (const v of m.value.split("|")) check(values.has(v), `${where}: ${s.name}{${m.label}=~"...${v}..."}: ${v} is a value it takes (values: ${[...values].join(", ")})`);
        }
      }
    }
    for (const g of [...parsed.grouping, ...(groupLabels ?? [])]) {
      check(known.has(g), `${where}: grouping label ${g} is a label of the series it groups or a target label`);
    }
  }
  console.log(`metric families used: ${[...used].sort().join(", ")}`);
  finish("metric names against the scrapes");
}

// ---------------------------------------------------------------- queries
async function queries() {
  const base = opts.prometheus;
  if (!base) {
    console.error(usage);
    process.exit(2);
  }
  const query = async (q) => {
    const r = await fetch(`${base}/api/v1/query?query=${encodeURIComponent(q)}`);
    return r.json();
  };
  const d = loadDashboard();
  for (const p of panelsOf(d)) {
    for (const t of p.targets ?? []) {
      if (!t.expr) continue;
      const q = expand(t.expr, "15s");
      const r = await query(q);
      if (!check(r.status === "success", `panel "${p.title}" ${t.refId}: evaluates (${r.error ?? ""}): ${q}`)) continue;
      check(r.data.result.length > 0, `panel "${p.title}" ${t.refId}: returns data from the running binaries: ${q}`);
    }
  }
  for (const v of variableQueries(d)) {
    if (!v.selector) continue;
    const r = await (await fetch(`${base}/api/v1/label/${v.label}/values?match[]=${encodeURIComponent(expand(v.selector))}`)).json();
    check(r.status === "success" && r.data.length > 0, `variable $${v.name}: ${v.query} lists values (got ${JSON.stringify(r.data ?? r.error)})`);
  }
  for (const rule of rulesOf(loadRule())) {
    const r = await query(String(rule.expr));
    check(r.status === "success", `rule ${rule.alert ?? rule.record}: evaluates (${r.error ?? ""})`);
  }
  // The annotations' queries feed the alert text: they must find data.
  for (const e of expressions(d, loadRule()).filter((x) => x.where.includes(" annotation "))) {
    const r = await query(e.expr);
    check(r.status === "success" && r.data.result.length > 0, `${e.where}: returns data (${r.error ?? `${r.data?.result?.length} series`}): ${e.expr}`);
  }
  if (failures.length > 0) {
    // What Prometheus had of each target, to tell a scrape problem apart.
    for (const q of ["up", "count_over_time(up[15s])", "sum_over_time(up[15s])", "scrape_duration_seconds"]) {
      const r = await query(q);
      for (const x of r.data?.result ?? []) console.log(`  ${q} ${x.metric.job}: ${x.value[1]}`);
    }
  }
  finish("dashboard and rule queries against Prometheus");
}

// ---------------------------------------------------------------- rules
function writeRules() {
  if (!opts.out) {
    console.error(usage);
    process.exit(2);
  }
  writeFileSync(path.join(opts.out, "rules.yaml"), YAML.stringify(loadRule().spec));
}

// ---------------------------------------------------------------- alerts
// Every rule loaded by the Prometheus at URL has been evaluated without
// error; then each alert of --active=NAME,... becomes active (pending or
// firing) with the labels of --labels=K=V,... within --timeout seconds, and
// no alert is active but those and the ones --allow=NAME,... names.
async function alerts() {
  const base = opts.prometheus;
  if (!base) {
    console.error(usage);
    process.exit(2);
  }
  const list = (v) => (v ?? "").split(",").filter(Boolean);
  const want = list(opts.active);
  const allowed = new Set([...want, ...list(opts.allow)]);
  const labels = Object.fromEntries(list(opts.labels).map((kv) => kv.split("=")));
  const deadline = Date.now() + Number(opts.timeout ?? 20) * 1000;
  const get = async (p) => (await fetch(`${base}${p}`)).json();
  let rules = [];
  for (;;) {
    const r = await get("/api/v1/rules");
    rules = (r.data?.groups ?? []).flatMap((g) => g.rules);
    if (rules.length > 0 && rules.every((x) => x.health !== "unknown")) break;
    if (Date.now() > deadline) break;
    await new Promise((res) => setTimeout(res, 500));
  }
  const expected = rulesOf(loadRule()).length;
  check(rules.length === expected, `Prometheus loaded the ${expected} rules (found ${rules.length})`);
  for (const x of rules) check(x.health === "ok", `rule ${x.name}: evaluated by Prometheus without error (health ${x.health}${x.lastError ? `: ${x.lastError}` : ""})`);
  const matches = (a, name) => a.labels.alertname === name && Object.entries(labels).every(([k, v]) => a.labels[k] === v);
  let active = [];
  for (;;) {
    const r = await get("/api/v1/alerts");
    active = (r.data?.alerts ?? []).filter((a) => ["pending", "firing"].includes(a.state));
    if (want.every((n) => active.some((a) => matches(a, n))) || Date.now() > deadline) break;
    await new Promise((res) => setTimeout(res, 500));
  }
  const show = (a) => `${a.labels.alertname}{${Object.entries(a.labels).filter(([k]) => k !== "alertname").map(([k, v]) => `${k}="${v}"`).join(",")}} ${a.state}`;
  for (const n of want) {
    check(active.some((a) => matches(a, n)), `${n} with ${JSON.stringify(labels)} is active (active: ${active.map(show).join("; ") || "none"})`);
  }
  for (const a of active.filter((x) => !allowed.has(x.labels.alertname))) check(false, `no other alert is active: ${show(a)}`);
  for (const a of active) console.log(`active: ${show(a)}\n  ${a.annotations?.description ?? ""}`);
  finish(want.length ? `alerts ${want.join(", ")} on the running binaries` : "no alert on the healthy running binaries");
}

if (cmd === "static") await staticChecks();
else if (cmd === "names") namesCheck();
else if (cmd === "queries") await queries();
else if (cmd === "rules") writeRules();
else if (cmd === "alerts") await alerts();
else {
  console.error(usage);
  process.exit(2);
}
