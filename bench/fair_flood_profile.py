"""Where tenant B's jobs spent their time in ``bench/fair.py``'s flood (ADR 0021, "The pick's
cost"): reads the JSON that ``fair.py --only flood --profile-out FILE`` writes and prints, per B
job and as medians, submit -> row inserted -> accepted, commit -> the next slot freed, commit ->
picked (``conversion_job.dispatched_at``: the pick's transaction start, so it includes the wait
for the pick's lock), the slot freed -> picked, picked -> confirmed (outbox ``published_at``),
picked -> claimed (``conversion_attempt.started_at``), claimed -> finished, and who held the
slots at B's commit.

    .venv/bin/python bench/fair_flood_profile.py FILE
"""

from __future__ import annotations

import json
import statistics
import sys

KEYS = (
    "submit_to_insert",
    "insert_to_accepted",
    "commit_to_next_free",
    "commit_to_pick",
    "free_to_pick",
    "pick_to_confirm",
    "pick_to_claim",
    "claim_to_end",
    "total",
)


def breakdown(data: dict) -> list[dict]:
    sent = {b[0]: b for b in data["b_sent"]}
    attempts = data["attempts"]
    ends = sorted(a[3] for a in attempts if a[3] is not None)
    rows = []
    for r in data["b_rows"]:
        job, created, _q, picked, _oc, confirmed, _pa, _err, started, ended, finished, _w = r
        _, submitted, accepted = sent[job]
        before = [e for e in ends if e <= picked]
        after = [e for e in ends if e >= created]
        held = [a[0] for a in attempts if a[2] <= created and (a[3] or float("inf")) > created]
        rows.append(
            {
                "submit_to_insert": created - submitted,
                "insert_to_accepted": accepted - created,
                "commit_to_next_free": (min(after) - created) if after else None,
                "commit_to_pick": picked - created,
                "free_to_pick": (picked - max(before)) if before else None,
                "pick_to_confirm": confirmed - picked,
                "pick_to_claim": started - picked,
                "claim_to_end": ended - started,
                "total": finished - submitted,
                "held": ",".join(t[-1] for t in held),
            }
        )
    return sorted(rows, key=lambda x: x["total"])


def main() -> int:
    rows = breakdown(json.loads(open(sys.argv[1]).read()))
    print("ms   " + " ".join(k[:14].rjust(14) for k in KEYS) + "  slots at commit")
    for i, x in enumerate(rows):
        cells = (f"{x[k] * 1000:14.1f}" if x[k] is not None else " " * 14 for k in KEYS)
        print(f"{i:3d}  " + " ".join(cells) + f"  {x['held']}")
    for k in KEYS:
        values = sorted(x[k] for x in rows if x[k] is not None)
        print(
            f"{k:22s} p50 {statistics.median(values) * 1000:7.1f}  max {values[-1] * 1000:7.1f} ms"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
