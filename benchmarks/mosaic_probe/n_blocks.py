"""Instructions per basic block of one kernel, from an `ncu --page source --csv --print-source
sass` export (`n_run.sh "src:..."` keeps it as `src_NAME.csv.gz`): consecutive SASS rows with
the same execution count are one block; prints the blocks that hold at least 1% of the
executed warp instructions: first row, address, executions (warp level) x instructions, share,
stall samples and the commonest opcodes. The consumers' loop bodies (a masked and an unmasked
key block, the per-piece decode) stand out by their execution counts.

  python3 benchmarks/mosaic_probe/n_blocks.py out/src_lmfA.csv.gz
"""
import collections, csv, gzip, sys

rows = list(csv.reader(gzip.open(sys.argv[1], "rt", errors="replace")))
start = next(i for i, r in enumerate(rows) if "Address" in r)
head = rows[start]
body = [r for r in rows[start + 1:] if len(r) == len(head)]
A, S = head.index("Address"), head.index("Source")
W, E = head.index("Warp Stall Sampling (All Samples)"), head.index("Instructions Executed")
num = lambda x: float(x.replace(",", "") or 0) if x.replace(",", "").replace(".", "").isdigit() \
    else 0.0
groups = []
for i, r in enumerate(body):
  if not groups or num(r[E]) != groups[-1][1]:
    groups.append([i, num(r[E]), collections.Counter(), 0.0])
  op = [o for o in r[S].split() if not o.startswith("@")]
  groups[-1][2][op[0].split(".")[0] if op else "?"] += 1
  groups[-1][3] += num(r[W])
total = sum(num(r[E]) for r in body)
print(f"executed warp instructions {total:.0f}, stall samples {sum(g[3] for g in groups):.0f}")
for first, execs, ops, samples in groups:
  n = sum(ops.values())
  if execs * n > 0.01 * total:
    print(f"row {first:5d} {body[first][A][-5:]} exec {execs:8.0f} x {n:4d} = "
          f"{100 * execs * n / total:4.1f}%  samples {samples:6.0f}  {dict(ops.most_common(9))}")
