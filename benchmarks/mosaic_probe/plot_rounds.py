"""Speed relative to the peer from `m_persistent.py` logs (their JSON lines): per shape, the
peer's median time over ours (and over tokamax's, when timed), forward and forward+backward,
as bars around 1 (above: faster than the peer; dashed: LongNet's goals of issue 13). Rows of
several logs are all drawn, labelled by log, so that run-to-run spread shows.

  python3 benchmarks/mosaic_probe/plot_rounds.py LOG... --out speed.png [--labels a,b]
"""
import argparse
import json
import statistics
from pathlib import Path

ap = argparse.ArgumentParser()
ap.add_argument("logs", nargs="+")
ap.add_argument("--out", required=True)
ap.add_argument("--labels", default=None, help="comma-separated, one a log (default: names)")
ap.add_argument("--title", default="ours (mosaic) and tokamax against the peer, H100, bf16")
args = ap.parse_args()
labels = args.labels.split(",") if args.labels else [Path(p).stem for p in args.logs]

bars = []  # (shape, run label, impl, pass, peer time / impl time)
for path, label in zip(args.logs, labels):
  for line in Path(path).read_text().splitlines():
    if not line.startswith("{") or '"peer_fwd"' not in line:
      continue
    row = json.loads(line)
    causal = " causal" if "causal" in row["kind"] else ""
    shape = (f"{row['kind'].replace('-causal', '')}{causal}\n"
             f"{row['n'] // 1024}K D={row['d']}")
    for impl, key in (("ours", "default"), ("tokamax", "tokamax")):
      for p in ("fwd", "fwdbwd"):
        if row.get(f"{key}_{p}") and row.get(f"peer_{p}"):
          speed = statistics.median(row[f"peer_{p}"]) / statistics.median(row[f"{key}_{p}"])
          bars.append((shape, label, impl, p, speed))

import matplotlib  # pylint: disable=g-import-not-at-top
matplotlib.use("Agg")
import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top

shapes = list(dict.fromkeys(b[0] for b in bars))
series = list(dict.fromkeys((b[1], b[2]) for b in bars))
fig, axes = plt.subplots(2, 1, figsize=(max(8, 1.3 * len(shapes)), 7), sharex=True)
width = 0.8 / max(len(series), 1)
for ax, p in zip(axes, ("fwd", "fwdbwd")):
  for i, (label, impl) in enumerate(series):
    xs, ys = [], []
    for j, shape in enumerate(shapes):
      for b in bars:
        if b[:4] == (shape, label, impl, p):
          xs.append(j + (i - (len(series) - 1) / 2) * width)
          ys.append(b[4])
    ax.bar(xs, ys, width, label=f"{impl} ({label})")
  ax.axhline(1.0, color="k", lw=0.8)
  goal = 1 / (0.70 if p == "fwd" else 0.75)  # issue 13's LongNet goal, as a speed
  ax.axhline(goal, color="gray", ls="--", lw=0.8, label="LongNet goal" if p == "fwd" else None)
  ax.set_ylabel("peer time / time")
  ax.set_title(("forward" if p == "fwd" else "forward+backward")
               + " (peer: cuDNN for full attention, folded cuDNN for LongNet)")
  ax.set_ylim(0.8, max([b[4] for b in bars if b[3] == p] + [1.2]) * 1.05)
axes[-1].set_xticks(range(len(shapes)), shapes, fontsize=8)
axes[0].legend(fontsize=7, ncol=2)
fig.suptitle(args.title)
fig.tight_layout()
fig.savefig(args.out, dpi=110)
print(f"wrote {args.out}: {len(shapes)} shapes, {len(series)} series")
