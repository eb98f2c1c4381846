"""Print a per-version summary of a run from its staleness log (offline, read-only).

    python analysis/summary.py RUN_DIR

One row per trainer version: groups consumed, mean reward, lag histogram. The
full report with plots comes with the [analysis] issue; this reads the same
public API, ``hpcrl.logs.read_staleness``.
"""
from __future__ import annotations

import argparse

from hpcrl.logs import read_staleness


def summarize(run_dir: str):
    st = read_staleness(run_dir)
    if st.empty:
        return st
    groups = st.drop_duplicates("group_id")
    table = groups.groupby("trainer_version").agg(groups=("group_id", "count"), lag_mean=("lag", "mean"),
                                                  lag_max=("lag", "max"))
    table["reward_mean"] = st.groupby("trainer_version")["reward"].mean()
    return table


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("run_dir")
    a = p.parse_args()
    table = summarize(a.run_dir)
    if table.empty:
        print("no consumed trajectories yet")
        return
    print(table.to_string(float_format=lambda x: f"{x:.3f}"))
    st = read_staleness(a.run_dir)
    print(f"\n{len(st)} trajectories, lag histogram (trajectories): {st.lag.value_counts().sort_index().to_dict()}")


if __name__ == "__main__":
    main()
