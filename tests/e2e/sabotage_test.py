#!/usr/bin/env python3
"""The failure-injection suite can fail: one short scenario run with
--sabotage (after the load the harness deletes a charge and inserts an inbox
row nobody committed, as a bug would) must FAIL, exit 1, and report both
violations with their examples: I1 (the missing effect) and I4 (the
phantom). A harness or checker that stopped seeing violations would pass
every chaos run; this test would not.

    python3 tests/e2e/sabotage_test.py [--bin build/bin]
"""

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--bin", default=os.path.join(ROOT, "build", "bin"))
    ap.add_argument("--scenario", default="relay-kill")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="outbox-sabotage-") as tmp:
        out = os.path.join(tmp, "result.json")
        r = subprocess.run(
            [sys.executable, "-u", os.path.join(ROOT, "tests", "e2e", "chaos.py"),
             "--seconds", "3", "--seed", "28", "--scenario", args.scenario,
             "--sabotage", "--json", out, "--bin", args.bin],
            stdin=subprocess.DEVNULL, capture_output=True, text=True,
            timeout=900)
        log = r.stdout + r.stderr
        problems = []
        if r.returncode != 1:
            problems.append(f"exit {r.returncode}, expected 1 (a violation)")
        try:
            with open(out) as f:
                results = json.load(f)["results"]
        except (OSError, ValueError, KeyError) as e:
            print(log[-4000:])
            print(f"FAIL: no JSON result: {e}")
            return 1
        if len(results) != 1:
            problems.append(f"{len(results)} results, expected 1")
        res = results[0] if results else {}
        if res.get("result") != "FAIL":
            problems.append(f"result {res.get('result')!r}, expected 'FAIL' "
                            f"(errors: {res.get('errors')})")
        violations = res.get("violations", [])
        examples = res.get("examples", [])
        for label, want_v, want_ex in (
                ("I1", "I1 missing effects: 1", "I1 effect: "),
                ("I4", "I4 phantoms: 1", "I4 phantom: event ")):
            if want_v not in violations:
                problems.append(f"no {label} violation {want_v!r} in "
                                f"{violations}")
            if not any(e.startswith(want_ex) for e in examples):
                problems.append(f"no {label} example starting {want_ex!r} in "
                                f"{examples}")
        # Nothing else broke: the sabotage is the only cause.
        others = [v for v in violations
                  if not v.startswith(("I1 missing effects", "I4 phantoms"))]
        if others:
            problems.append(f"other violations besides the sabotage: {others}")
        if problems:
            print(log[-6000:])
            for p in problems:
                print(f"FAIL: {p}")
            return 1
        print(f"ok: a sabotaged {args.scenario} run FAILs with {violations} "
              f"and examples {examples[:2]}")
        # The suite keeps a failed scenario's logs and evidence for whoever
        # investigates; this failure was the expected one.
        kept = res.get("workdir") or ""
        if os.path.basename(kept).startswith(f"outbox-chaos-{args.scenario}."):
            shutil.rmtree(kept, ignore_errors=True)
        return 0


if __name__ == "__main__":
    sys.exit(main())
