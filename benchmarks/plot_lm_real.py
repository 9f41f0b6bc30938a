"""One figure from several examples/lm_real.py result files: held-out bits per byte by position
in the window (mean over seeds) and bits per byte against training tokens/s (mean and sample
std over seeds), one series per `LABEL=MODEL@FILE[,FILE...]`.

  python benchmarks/plot_lm_real.py --out lm.png \
      "full=full@a.json,b.json" "dilated=dilated@c.json" ...

Runs of other step counts than `--steps` are left out; each series prints its figures.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples"))
from common import mean_std  # noqa: E402  (the examples' own mean and sample std)


def series(spec: str, steps: int) -> tuple[str, list[dict]]:
  label, _, rest = spec.partition("=")
  model, _, files = rest.partition("@")
  if not (label and model and files):
    raise ValueError(f"a series is LABEL=MODEL@FILE[,FILE...], got {spec!r}")
  runs = {}
  for path in files.split(","):
    with open(path) as fh:
      for run in json.load(fh)["runs"]:
        if run["model"] == model and run["steps"] == steps:
          runs[run["seed"]] = run
  if not runs:
    raise ValueError(f"no {model} runs of {steps} steps in {files}")
  return label, [runs[s] for s in sorted(runs)]


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("series", nargs="+", help="LABEL=MODEL@FILE[,FILE...]")
  ap.add_argument("--steps", type=int, default=600)
  ap.add_argument("--title", default="")
  ap.add_argument("--out", required=True)
  args = ap.parse_args(argv)
  fig, (by_pos, speed) = plt.subplots(1, 2, figsize=(12, 4.5))
  for spec in args.series:
    label, runs = series(spec, args.steps)
    bpb, std = mean_std([r["heldout_bpb"] for r in runs])
    tok = [r["tokens_per_s"] for r in runs]
    edges = runs[0]["position_edges"]
    pos = [mean_std([r["bpb_by_position"][i] for r in runs])[0] for i in range(len(edges) - 1)]
    by_pos.plot([max(e, 32) for e in edges[:-1]], pos, marker="o", label=label)
    speed.errorbar(mean_std(tok)[0], bpb, yerr=std, fmt="o", capsize=4, label=label)
    print(f"{label}: seeds {[r['seed'] for r in runs]}, bpb {bpb:.4f} +- {std:.4f}, "
          f"tokens/s {min(tok):,.0f}-{max(tok):,.0f}")
  by_pos.set_xscale("log", base=2)
  by_pos.set_xlabel("position in the window (bucket start; 0 drawn at 32)")
  by_pos.set_ylabel("held-out bits per byte (mean over seeds)")
  by_pos.legend(fontsize=8)
  by_pos.grid(alpha=0.3)
  speed.set_xlabel("training tokens/s")
  speed.set_ylabel("held-out bits per byte (mean +- std over seeds)")
  lo, hi = speed.get_ylim()
  speed.set_ylim(lo, hi + 0.6 * (hi - lo))  # room for the legend above the points
  speed.legend(fontsize=8, loc="upper left")
  speed.grid(alpha=0.3)
  fig.suptitle(args.title)
  fig.tight_layout()
  fig.savefig(args.out, dpi=110)
  print(f"plot: {args.out}")


if __name__ == "__main__":
  main()
