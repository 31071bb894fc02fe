// What the kubelet gives a container, as `podman run` options: the pod's
// and the container's securityContext (user and group, fsGroup, read-only
// root, capabilities, privilege escalation, seccomp), emptyDir volumes and
// resource limits. A field this mapping does not know is reported rather
// than left out, so that a manifest change cannot make the image test run
// the containers with fewer restrictions than the pods have.
// Used by tests/deploy/image_args.mjs (tests/deploy/run_image.sh).

import { parseQuantity } from "./k8s.mjs";

const POD_FIELDS = new Set(["runAsUser", "runAsGroup", "runAsNonRoot", "fsGroup", "fsGroupChangePolicy", "supplementalGroups", "seccompProfile"]);
const CONTAINER_FIELDS = new Set(["runAsUser", "runAsGroup", "runAsNonRoot", "readOnlyRootFilesystem", "capabilities", "allowPrivilegeEscalation", "privileged", "seccompProfile"]);

// podmanRunArgs(podSpec, container) -> { args: [...], unsupported: [...], user: { uid, gid } }
export function podmanRunArgs(spec, c) {
  const psc = spec.securityContext ?? {};
  const sc = c.securityContext ?? {};
  const unsupported = [];
  for (const k of Object.keys(psc)) if (!POD_FIELDS.has(k)) unsupported.push(`pod securityContext.${k}`);
  for (const k of Object.keys(sc)) if (!CONTAINER_FIELDS.has(k)) unsupported.push(`container securityContext.${k}`);
  const get = (k) => sc[k] ?? psc[k];
  const args = [];
  const uid = get("runAsUser");
  const gid = get("runAsGroup");
  if (get("runAsNonRoot") === true && !(Number.isInteger(uid) && uid > 0)) {
    unsupported.push("runAsNonRoot without a numeric runAsUser other than 0 (the image's USER would decide)");
  }
  if (uid !== undefined) args.push(`--user=${uid}${gid !== undefined ? `:${gid}` : ""}`);
  if (Number.isInteger(psc.fsGroup)) args.push(`--group-add=${psc.fsGroup}`);
  for (const g of psc.supplementalGroups ?? []) args.push(`--group-add=${g}`);
  // Kubernetes gives a read-only root no tmpfs of its own (podman would
  // mount /tmp, /var/tmp and /run writable): only the emptyDir volumes.
  if (sc.readOnlyRootFilesystem === true) args.push("--read-only", "--read-only-tmpfs=false");
  for (const cap of sc.capabilities?.drop ?? []) args.push(`--cap-drop=${cap}`);
  for (const cap of sc.capabilities?.add ?? []) args.push(`--cap-add=${cap}`);
  for (const k of Object.keys(sc.capabilities ?? {})) if (k !== "drop" && k !== "add") unsupported.push(`capabilities.${k}`);
  if (sc.allowPrivilegeEscalation === false) args.push("--security-opt=no-new-privileges");
  if (sc.privileged === true) args.push("--privileged");
  const seccomp = get("seccompProfile")?.type;
  // RuntimeDefault: the runtime's default profile, which podman applies
  // unless told otherwise.
  if (seccomp === "Unconfined") args.push("--security-opt=seccomp=unconfined");
  else if (seccomp !== undefined && seccomp !== "RuntimeDefault") unsupported.push(`seccompProfile.type ${seccomp}`);
  for (const m of c.volumeMounts ?? []) {
    const v = (spec.volumes ?? []).find((x) => x.name === m.name);
    if (v?.emptyDir) args.push(`--tmpfs=${m.mountPath}:rw,nosuid,nodev${v.emptyDir.sizeLimit ? `,size=${parseQuantity(v.emptyDir.sizeLimit)}` : ""}`);
    else if (!v?.secret) unsupported.push(`volume ${m.name} (only Secret and emptyDir volumes are mapped)`);
  }
  const lim = c.resources?.limits ?? {};
  if (lim.memory !== undefined) args.push(`--memory=${parseQuantity(lim.memory)}`);
  if (lim.cpu !== undefined) args.push(`--cpus=${parseQuantity(lim.cpu)}`);
  return { args, unsupported, user: { uid, gid } };
}
