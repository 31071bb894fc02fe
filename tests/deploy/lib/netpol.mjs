// A small evaluator of networking.k8s.io/v1 NetworkPolicy semantics, enough
// to check who may reach whom in a rendered overlay without a cluster.
//
// An endpoint is either a pod:
//   { pod: true, name, namespace, nsLabels, labels, ports: [{name, containerPort, protocol}] }
// or an address outside the cluster's pods:
//   { pod: false, name, ip: "203.0.113.10" }

import { matchSelector } from "./k8s.mjs";

function ipv4ToInt(ip) {
  const p = ip.split(".").map(Number);
  if (p.length !== 4 || p.some((x) => !Number.isInteger(x) || x < 0 || x > 255)) return null;
  return ((p[0] << 24) >>> 0) + (p[1] << 16) + (p[2] << 8) + p[3];
}

function inCidr(ip, cidr) {
  const [net, bitsText] = cidr.split("/");
  const a = ipv4ToInt(ip);
  const n = ipv4ToInt(net);
  if (a === null || n === null) return false; // IPv6 not modelled
  const bits = Number(bitsText ?? 32);
  if (bits === 0) return true;
  const mask = (~0 << (32 - bits)) >>> 0;
  return ((a & mask) >>> 0) === ((n & mask) >>> 0);
}

function policyTypes(np) {
  if (np.spec?.policyTypes) return np.spec.policyTypes;
  return np.spec?.egress ? ["Ingress", "Egress"] : ["Ingress"];
}

function peerMatches(peer, policyNs, ep) {
  if (peer.ipBlock) {
    if (ep.pod) return false; // pod IPs are not modelled
    if (!inCidr(ep.ip, peer.ipBlock.cidr)) return false;
    return !(peer.ipBlock.except ?? []).some((c) => inCidr(ep.ip, c));
  }
  if (!ep.pod) return false;
  if (peer.namespaceSelector) {
    if (!matchSelector(peer.namespaceSelector, ep.nsLabels)) return false;
  } else if (ep.namespace !== policyNs) {
    return false;
  }
  if (peer.podSelector) return matchSelector(peer.podSelector, ep.labels);
  return true;
}

// Does a rule's `ports` admit `port`/`protocol` on destination `dst`?
function portMatches(rulePorts, dst, port, protocol) {
  if (!rulePorts || rulePorts.length === 0) return true;
  return rulePorts.some((rp) => {
    if ((rp.protocol ?? "TCP") !== protocol) return false;
    if (rp.port === undefined) return true;
    if (typeof rp.port === "number" || /^\d+$/.test(String(rp.port))) {
      const lo = Number(rp.port);
      const hi = rp.endPort ?? lo;
      return port >= lo && port <= hi;
    }
    // A named port is resolved on the destination pod.
    if (!dst.pod) return false;
    return (dst.ports ?? []).some(
      (p) => p.name === rp.port && p.containerPort === port && (p.protocol ?? "TCP") === protocol,
    );
  });
}

function selecting(policies, ep, type) {
  return policies.filter(
    (np) =>
      ep.pod &&
      (np.metadata?.namespace ?? ep.namespace) === ep.namespace &&
      policyTypes(np).includes(type) &&
      matchSelector(np.spec?.podSelector ?? {}, ep.labels),
  );
}

export function ingressAllowed(policies, src, dst, port, protocol = "TCP") {
  if (!dst.pod) return true;
  const pols = selecting(policies, dst, "Ingress");
  if (pols.length === 0) return true;
  return pols.some((np) =>
    (np.spec.ingress ?? []).some(
      (rule) =>
        (!rule.from || rule.from.length === 0 || rule.from.some((peer) => peerMatches(peer, np.metadata?.namespace ?? dst.namespace, src))) &&
        portMatches(rule.ports, dst, port, protocol),
    ),
  );
}

export function egressAllowed(policies, src, dst, port, protocol = "TCP") {
  if (!src.pod) return true;
  const pols = selecting(policies, src, "Egress");
  if (pols.length === 0) return true;
  return pols.some((np) =>
    (np.spec.egress ?? []).some(
      (rule) =>
        (!rule.to || rule.to.length === 0 || rule.to.some((peer) => peerMatches(peer, np.metadata?.namespace ?? src.namespace, dst))) &&
        portMatches(rule.ports, dst, port, protocol),
    ),
  );
}

export function allowed(policies, src, dst, port, protocol = "TCP") {
  return egressAllowed(policies, src, dst, port, protocol) && ingressAllowed(policies, src, dst, port, protocol);
}

export function isolated(policies, ep, type) {
  return selecting(policies, ep, type).length > 0;
}
