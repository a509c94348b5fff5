"""kill -9 at seeded random points of checkpoint saves, then resume: a longer sweep than the test.

Uses the tiny set-up and the fork-and-kill helpers of ``tests/trainer/test_checkpoint_faults.py``:
one uninterrupted reference run (6 steps, a checkpoint every 2 steps), then ``--kills``
runs each killed by SIGKILL at a seeded random profile event inside the saves of steps 4
and 6 (half of them inside the rotation that deletes the previous checkpoint, with
``--in-rotation``), each followed by ``resume_from_checkpoint=True`` to step 6. Prints, per
kill, the checkpoint folders left on disk (complete or not) and whether the resumed run
ended bitwise equal to the reference::

    PYTHONPATH=$PWD HF_HUB_OFFLINE=1 python benchmarks/fault_injection_sweep.py --seed 7 --kills 12
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import tempfile

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir, "tests"))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir, "tests", "trainer"))
import test_checkpoint_faults as faults  # noqa: E402
from common import write_json  # noqa: E402

from hf_constrained.checkpointing import checkpoint_folders, checkpoint_problem  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--kills", type=int, default=12)
    parser.add_argument("--limit", type=int, default=1, help="save_total_limit (0: none)")
    parser.add_argument("--in-rotation", action="store_true", help="put every other kill inside a rotation")
    parser.add_argument("--json", default=None, help="write the results here")
    a = parser.parse_args()
    limit = a.limit or None
    tmp = tempfile.mkdtemp(prefix="fault_sweep_")
    count, snap = os.path.join(tmp, "count.json"), os.path.join(tmp, "ref.pt")
    assert faults._in_child(lambda: faults._run(os.path.join(tmp, "ref"), limit, count_file=count,
                                                snap_file=snap)) == 0
    reference = torch.load(snap, weights_only=False)
    with open(count) as f:
        counted = json.load(f)
    total = counted["total"]
    rotations = [r for r in counted["rotations"] if r[1] - r[0] > 10]
    rng = random.Random(a.seed)
    rows = []
    for i in range(a.kills):
        if a.in_rotation and rotations and i % 2:
            kill_at = rng.randint(*rotations[rng.randrange(len(rotations))])
        else:
            kill_at = rng.randint(1, total)
        out = os.path.join(tmp, f"kill{i}")
        status = faults._in_child(lambda: faults._run(out, limit, kill_at=kill_at))
        killed = os.WIFSIGNALED(status)
        left = {os.path.basename(p): checkpoint_problem(p) is None for p in checkpoint_folders(out)}
        resumed = os.path.join(tmp, f"resumed{i}.pt")
        ok = faults._in_child(lambda: faults._run(out, limit, resume=True, snap_file=resumed)) == 0
        equal = False
        if ok:
            try:
                faults._assert_same(reference, torch.load(resumed, weights_only=False))
                equal = True
            except AssertionError:
                pass
        rows.append({"kill_at": kill_at, "killed": killed, "checkpoints_complete": left, "resumed": ok,
                     "bitwise_equal": equal})
        print(f"kill at event {kill_at}/{total}: left {left} -> resume {'ok' if ok else 'FAILED'}, "
              f"{'bitwise equal' if equal else 'DIFFERENT'}")
    good = sum(r["bitwise_equal"] for r in rows)
    print(f"{good}/{len(rows)} kills resumed bitwise equal to the uninterrupted run")
    write_json(a.json, {"seed": a.seed, "limit": limit, "events": total, "kills": rows, "bitwise_equal": good},
               echo=False)


if __name__ == "__main__":
    main()
