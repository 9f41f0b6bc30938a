"""The SASS instructions with the most warp-stall samples in an `ncu --page source --csv
--print-source sass` export (argv[1]): the total per stall reason, then the top 40 rows."""
import csv, sys

rows = list(csv.reader(open(sys.argv[1], errors="replace")))
start = next(i for i, r in enumerate(rows) if any("Sampling" in c for c in r))
head, body = rows[start], [r for r in rows[start + 1:] if len(r) == len(rows[start])]
num = lambda x: float(x.replace(",", "") or 0) if x.replace(",", "").replace(".", "").isdigit() else 0.0
total = next(i for i, c in enumerate(head) if "Sampling (All" in c)
src = next((i for i, c in enumerate(head) if c.lower() in ("source", "sass")), 1)
reasons = [i for i, c in enumerate(head) if c.startswith("stall_") or "Stall" in c and i != total]
print("columns:", head)
print("samples:", sum(num(r[total]) for r in body))
for i in reasons:
  t = sum(num(r[i]) for r in body)
  if t:
    print(f"  {head[i]}: {t:.0f}")
for r in sorted(body, key=lambda r: -num(r[total]))[:40]:
  print(f"{num(r[total]):8.0f}  {r[0]:>6}  {r[src][:90]}  " +
        " ".join(f"{head[i][:18]}={num(r[i]):.0f}" for i in reasons if num(r[i]) > 0.1 * num(r[total])))
