// Stands in for cert-manager and the kubelet on one machine, for
// rendered.mjs: issues real certificates (openssl) for the rendered
// cert-manager.io/v1 Certificates, following their Issuers (selfSigned, ca),
// and lays each Secret out the way the kubelet mounts a Secret volume:
//
//   DIR/<secret>/..2026_11_29_15_00_00.1/{tls.crt,tls.key,ca.crt}
//   DIR/<secret>/..data -> ..2026_11_29_15_00_00.1
//   DIR/<secret>/tls.crt -> ..data/tls.crt         (and tls.key, ca.crt)
//
// A renewal (reissue) writes a new timestamped directory and swaps ..data
// with one rename, as the kubelet does when cert-manager updates the Secret:
// that is what the binaries' 5-second re-read has to cope with.

import { spawnSync } from "node:child_process";
import {
  mkdirSync, writeFileSync, readFileSync, symlinkSync, renameSync, rmSync, readlinkSync, existsSync, chmodSync, chownSync,
} from "node:fs";
import path from "node:path";

const API = "cert-manager.io/v1";

function openssl(args, what) {
  const r = spawnSync("openssl", args, { encoding: "utf8", timeout: 30000 });
  if (r.status !== 0) throw new Error(`openssl ${what}: ${(r.stderr || r.stdout || "").trim().split("\n").slice(-3).join(" | ")}`);
  return r.stdout;
}

const KEY_USAGE = {
  "digital signature": "digitalSignature", "key encipherment": "keyEncipherment", "content commitment": "nonRepudiation",
  "data encipherment": "dataEncipherment", "key agreement": "keyAgreement", "cert sign": "keyCertSign", "crl sign": "cRLSign",
  "encipher only": "encipherOnly", "decipher only": "decipherOnly",
};
const EXT_KEY_USAGE = {
  "server auth": "serverAuth", "client auth": "clientAuth", "code signing": "codeSigning", "email protection": "emailProtection",
  timestamping: "timeStamping", "ocsp signing": "OCSPSigning",
};

// objs: the rendered objects; dir: where the Secret volumes go.
// extraDnsNames(cert) -> names to add for the local run (e.g. localhost).
// group: the gid the Secret files belong to (the pods' fsGroup), applied
// when running as root, as the kubelet does.
export function makeCertManager(objs, dir, { extraDnsNames = () => [], fallbackCa = null, log = () => {}, group = null } = {}) {
  const certs = objs.filter((o) => o.apiVersion === API && o.kind === "Certificate");
  const issuers = objs.filter((o) => o.apiVersion === API && o.kind === "Issuer");
  const secrets = new Map(); // secretName -> { dir, cert, files: {tls.crt, tls.key, ca.crt} (current paths) }
  const work = path.join(dir, ".work");
  mkdirSync(work, { recursive: true });
  let generation = 0;

  const certOfSecret = (name) => certs.find((c) => c.spec?.secretName === name) ?? null;

  function newKey(c, file) {
    const pk = c.spec?.privateKey ?? {};
    const alg = pk.algorithm ?? "RSA";
    const args = alg === "ECDSA"
      ? ["genpkey", "-algorithm", "EC", "-pkeyopt", `ec_paramgen_curve:${{ 256: "P-256", 384: "P-384", 521: "P-521" }[pk.size ?? 256] ?? "P-256"}`]
      : alg === "Ed25519" ? ["genpkey", "-algorithm", "ED25519"]
        : ["genpkey", "-algorithm", "RSA", "-pkeyopt", `rsa_keygen_bits:${pk.size ?? 2048}`];
    openssl([...args, "-out", file], `key for ${c.metadata.name}`);
    // cert-manager's default encoding is PKCS1 (RSA / SEC1 EC keys).
    if ((pk.encoding ?? "PKCS1") === "PKCS1" && alg !== "Ed25519") {
      openssl([alg === "ECDSA" ? "ec" : "rsa", "-in", file, "-out", `${file}.1`, ...(alg === "RSA" ? ["-traditional"] : [])], "PKCS1 key");
      renameSync(`${file}.1`, file);
    }
  }

  function extensions(c) {
    const s = c.spec ?? {};
    const san = [
      ...(s.uris ?? []).map((u) => `URI:${u}`),
      ...[...new Set([...(s.dnsNames ?? []), ...extraDnsNames(c)])].map((d) => `DNS:${d}`),
      ...(s.ipAddresses ?? []).map((ip) => `IP:${ip}`),
      ...(s.emailAddresses ?? []).map((e) => `email:${e}`),
    ];
    const usages = s.usages ?? ["digital signature", "key encipherment"];
    const ku = new Set(usages.map((u) => KEY_USAGE[u]).filter(Boolean));
    if (s.isCA) {
      ku.add("keyCertSign");
      ku.add("cRLSign");
    }
    const eku = usages.map((u) => EXT_KEY_USAGE[u]).filter(Boolean);
    const lines = [
      `basicConstraints=critical,CA:${s.isCA ? "TRUE" : "FALSE"}`,
      "subjectKeyIdentifier=hash",
    ];
    if (ku.size) lines.push(`keyUsage=critical,${[...ku].join(",")}`);
    if (eku.length) lines.push(`extendedKeyUsage=${eku.join(",")}`);
    if (san.length) lines.push(`subjectAltName=${san.join(",")}`);
    return lines.join("\n") + "\n";
  }

  // The signer of Certificate c: { selfSigned: true } or { crt, key }.
  function signerOf(c) {
    const ref = c.spec?.issuerRef ?? {};
    const issuer = (ref.kind ?? "Issuer") === "Issuer" && (ref.group ?? "cert-manager.io") === "cert-manager.io"
      ? issuers.find((i) => i.metadata.name === ref.name) : null;
    if (issuer?.spec?.selfSigned) return { selfSigned: true };
    if (issuer?.spec?.ca) {
      const caSecret = issuer.spec.ca.secretName;
      const s = secrets.get(caSecret) ?? (certOfSecret(caSecret) ? issue(certOfSecret(caSecret)) : null);
      if (!s) throw new Error(`Issuer ${issuer.metadata.name}: Secret ${caSecret} is issued by no rendered Certificate`);
      return { crt: s.path("tls.crt"), key: s.path("tls.key"), ca: s.path("ca.crt") };
    }
    if (!fallbackCa) throw new Error(`Certificate ${c.metadata.name}: issuer ${ref.kind ?? "Issuer"}/${ref.name} is not a rendered selfSigned or CA Issuer`);
    log(`Certificate ${c.metadata.name}: issuer ${ref.kind ?? "Issuer"}/${ref.name} is not rendered here; signing with a throwaway CA`);
    const ca = fallbackCa();
    return { crt: ca.crt, key: ca.key, ca: ca.crt };
  }

  // Issues (or renews) the Certificate c and swaps its Secret's files.
  function issue(c) {
    const name = c.spec.secretName;
    const gen = ++generation;
    const w = path.join(work, `${name}.${gen}`);
    mkdirSync(w, { recursive: true });
    const prev = secrets.get(name);
    const key = path.join(w, "tls.key");
    if (prev && c.spec?.privateKey?.rotationPolicy !== "Always") writeFileSync(key, readFileSync(prev.path("tls.key")));
    else newKey(c, key);
    const ext = path.join(w, "ext.cnf");
    writeFileSync(ext, extensions(c));
    const csr = path.join(w, "req.csr");
    const cn = c.spec?.commonName ?? c.metadata.name;
    openssl(["req", "-new", "-key", key, "-subj", `/CN=${cn.replace(/\//g, "\\/")}`, "-out", csr], `request for ${c.metadata.name}`);
    const days = String(Math.max(1, Math.ceil((parseGoHours(c.spec?.duration) ?? 2160) / 24)));
    const crt = path.join(w, "tls.crt");
    const signer = signerOf(c);
    const serial = `0x${[...crypto.getRandomValues(new Uint8Array(16))].map((b) => b.toString(16).padStart(2, "0")).join("").replace(/^[89a-f]/, "1")}`;
    if (signer.selfSigned) {
      openssl(["x509", "-req", "-in", csr, "-signkey", key, "-days", days, "-set_serial", serial, "-extfile", ext, "-out", crt], `self-signed ${c.metadata.name}`);
    } else {
      openssl(["x509", "-req", "-in", csr, "-CA", signer.crt, "-CAkey", signer.key, "-days", days, "-set_serial", serial, "-extfile", ext, "-out", crt], `certificate ${c.metadata.name}`);
    }
    // ca.crt: the issuing CA (a self-signed certificate is its own).
    const files = {
      "tls.crt": readFileSync(crt),
      "tls.key": readFileSync(key),
      "ca.crt": signer.selfSigned ? readFileSync(crt) : readFileSync(signer.crt),
    };
    const entry = swapIn(name, files);
    entry.cert = c;
    rmSync(w, { recursive: true, force: true });
    return entry;
  }

  // The kubelet's atomic update of a Secret volume.
  function swapIn(name, files) {
    const vol = path.join(dir, name);
    mkdirSync(vol, { recursive: true });
    const stamp = new Date().toISOString().replace(/[-:T]/g, "_").replace(/\..*/, "");
    const ts = `..${stamp}.${generation}`;
    mkdirSync(path.join(vol, ts));
    for (const [k, v] of Object.entries(files)) {
      writeFileSync(path.join(vol, ts, k), v);
      if (group !== null && process.getuid?.() === 0) chownSync(path.join(vol, ts, k), 0, group);
      chmodSync(path.join(vol, ts, k), 0o440);
    }
    let old = null;
    try {
      old = readlinkSync(path.join(vol, "..data"));
    } catch {}
    symlinkSync(ts, path.join(vol, "..data_tmp"));
    renameSync(path.join(vol, "..data_tmp"), path.join(vol, "..data"));
    for (const k of Object.keys(files)) {
      if (!existsSync(path.join(vol, k))) symlinkSync(path.join("..data", k), path.join(vol, k));
    }
    if (old) rmSync(path.join(vol, old), { recursive: true, force: true });
    const entry = secrets.get(name) ?? { dir: vol, path: (k) => path.join(vol, k) };
    secrets.set(name, entry);
    return entry;
  }

  return {
    certs,
    certOfSecret,
    // Issues every rendered Certificate (CAs first, through signerOf).
    issueAll() {
      for (const c of certs) if (!secrets.has(c.spec.secretName)) issue(c);
      return secrets;
    },
    secret: (name) => secrets.get(name) ?? null,
    renew: (secretName) => issue(certOfSecret(secretName)),
  };
}

// Go duration with hours ("720h", "90m", "1h30m") -> hours.
function parseGoHours(d) {
  if (typeof d !== "string") return null;
  const re = /(\d+(?:\.\d+)?)(h|m|s|ms)/g;
  let total = 0;
  let m;
  let seen = false;
  while ((m = re.exec(d))) {
    seen = true;
    total += parseFloat(m[1]) * { h: 1, m: 1 / 60, s: 1 / 3600, ms: 1 / 3.6e6 }[m[2]];
  }
  return seen ? total : null;
}
