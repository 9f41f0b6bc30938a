"""PTX fingerprints of the "triton" backend's kernels, built on a CPU-only machine.

What it is for: proving that a change to the host code around the Triton kernels (schedule,
configs, dispatch, `triton_call` plumbing) leaves the compiled kernels unchanged. For a fixed
list of representative calls ("variants", each lowered forward and backward through the
public API `hilbert_ring_jax.dilated_attention(..., implementation="triton",
return_lse=True)` and `jax.vjp`) it records the sm_90 PTX of every Triton kernel launch, in
launch order, and hashes it. Run it on two checkouts and compare the JSON files: equal hashes
mean the same PTX, hence the same machine code (ptxas is deterministic). Each entry also
carries the launch parameters (grid, warps, stages, shared memory) under "launch"; the hashes
cover the PTX only. The schedule tables (runtime data passed to the kernels) are not covered.

How it works: no GPU is needed. `JAX_PLATFORMS=cpu`; each variant is traced from abstract
shapes and lowered with `lowering_platforms=("cuda",)`, which makes jax-triton compile each
`triton_call` (TTIR -> TTGIR -> LLIR -> PTX, all in-process; no ptxas). The harness
 - makes `jax.default_backend()` answer "gpu" while tracing/lowering (the backend refuses
   to run elsewhere);
 - wraps `jax_triton.triton_lib.get_or_create_triton_kernel` to pass `compute_capability=90`
   (there is no device to ask), to empty jax-triton's kernel cache before each launch (so
   every launch is compiled and recorded, even one identical to an earlier launch), and to
   record the kernel's PTX, name and launch parameters;
 - wraps `jax_triton.triton_lib.compile_ttir_to_ptx_inplace` (where jax-triton 0.3.1 turns
   TTIR into PTX; its result's `.binary` is the PTX text) to capture the PTX;
 - wraps `jax_triton.triton_lib.normalize_grid` to capture the launch grid.
Only the public API of hilbert_ring_jax is used, so the harness survives refactors of the
backend's private functions.

PTX is normalised before hashing: `.loc` and `.file` lines, `//` comment lines, blank lines,
`$L__tmpN:` labels (debug-range markers; never branch targets) and `.section .debug_*`
blocks are dropped, and trailing `// ...` comments and whitespace stripped. Debug info
moves with source line numbers (and `.file` names the checkout's path); the machine code
does not.

Setup (Python 3.11; triton 3.6.0 is the version on the GPU machines, so PTX matches theirs):
  /root/.pyenv/versions/3.11.7/bin/python -m venv /work/venvptx
  . /work/venvptx/bin/activate
  pip install "jax[cuda13]==0.10.2" "flax==0.12.8" numpy "jax-triton==0.3.1" "triton==3.6.0"
(pip may print harmless "Location ... is ignored" warnings.) Do not install hilbert_ring_jax
into the venv; choose the checkout with PYTHONPATH (the script prints the imported path).

Usage (from anywhere; the checkout imported is the one on PYTHONPATH):
  JAX_PLATFORMS=cpu PYTHONPATH=/path/to/checkout /work/venvptx/bin/python \\
      benchmarks/triton_ptx.py --out-json ptx.json [--ptx-dir ptx/] [--variants full,gqa_f32]
Compare with a baseline: add `--compare base.json` (prints per variant whether the PTX
hashes and the launch parameters match the baseline's; exit status 1 on any difference), or
`diff -r` two --ptx-dir folders. JSON: {variant: [{kernel, ordinal, sha256, lines,
launch}, ...]} in launch order; `ordinal` counts launches of that kernel within the variant;
`lines` is the number of normalised PTX lines. --ptx-dir writes
DIR/<variant>/<index>_<kernel>_<ordinal>.ptx (normalised).
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import dataclasses
import hashlib
import json
import os
import re
import sys
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

import jax_triton  # noqa: E402,F401
from jax_triton import triton_lib  # noqa: E402

import hilbert_ring_jax  # noqa: E402
from hilbert_ring_jax import DilatedPattern, dilated_attention  # noqa: E402

COMPUTE_CAPABILITY = 90


@dataclasses.dataclass(frozen=True)
class Variant:
  n: int
  pattern: DilatedPattern
  d: int = 128
  h: int = 4
  hkv: int = 4
  b: int = 1
  dtype: str = "bfloat16"


LONGNET = ((2048, 4096, 8192), (1, 2, 4))
VARIANTS = {
    "longnet": Variant(16384, DilatedPattern(*LONGNET)),
    "longnet_causal": Variant(16384, DilatedPattern(*LONGNET, causal=True)),
    "full": Variant(8192, DilatedPattern((8192,), (1,))),
    "full_causal": Variant(8192, DilatedPattern((8192,), (1,), causal=True)),
    "longnet_d64": Variant(16384, DilatedPattern(*LONGNET), d=64),
    # Segments that do not nest: several launches, the backward accumulating.
    "multi_group": Variant(4096, DilatedPattern((96, 160), (1, 2))),
    "gqa_f32": Variant(4096, DilatedPattern((1024, 4096), (1, 4)), h=8, hkv=2,
                       dtype="float32"),
    "offsets_all_f16": Variant(4096, DilatedPattern((512, 2048), (2, 4), offsets="all"),
                               dtype="float16"),
}


# ---------------------------------------------------------------------------------------
# Recording hooks around jax-triton.

_records: list[dict] = []  # one per launch lowered, in order
_pending: dict = {}  # filled by the hooks during one get_or_create_triton_kernel call


def _install_hooks():
  orig_get = triton_lib.get_or_create_triton_kernel
  orig_ptx = triton_lib.compile_ttir_to_ptx_inplace
  orig_grid = triton_lib.normalize_grid

  def compile_ttir_to_ptx_inplace(*args, **kwargs):
    result = orig_ptx(*args, **kwargs)
    _pending["ptx"] = result.binary
    _pending["name"] = result.name
    _pending["shared"] = result.shared_mem_bytes
    return result

  def normalize_grid(*args, **kwargs):
    grid = orig_grid(*args, **kwargs)
    _pending["grid"] = tuple(int(g) for g in grid)
    return grid

  def get_or_create_triton_kernel(*args, **kwargs):
    if kwargs.get("compute_capability") is None:
      kwargs["compute_capability"] = COMPUTE_CAPABILITY
    triton_lib._COMPILED_KERNEL_CACHE.clear()  # compile (and record) every launch
    for key in ("ptx", "name", "shared"):
      _pending.pop(key, None)
    out = orig_get(*args, **kwargs)
    if "ptx" not in _pending:
      raise RuntimeError("jax-triton returned a kernel without compiling it to PTX; the "
                         "hooks in benchmarks/triton_ptx.py no longer match jax-triton")
    _records.append(dict(
        ptx=_pending.pop("ptx"), name=_pending.pop("name"), shared=_pending.pop("shared"),
        grid=_pending.pop("grid", None), num_warps=kwargs.get("num_warps"),
        num_stages=kwargs.get("num_stages"), num_ctas=kwargs.get("num_ctas"),
        compute_capability=kwargs["compute_capability"]))
    return out

  triton_lib.compile_ttir_to_ptx_inplace = compile_ttir_to_ptx_inplace
  triton_lib.normalize_grid = normalize_grid
  triton_lib.get_or_create_triton_kernel = get_or_create_triton_kernel


@contextlib.contextmanager
def _pretend_gpu():
  orig = jax.default_backend
  jax.default_backend = lambda: "gpu"
  try:
    yield
  finally:
    jax.default_backend = orig


# ---------------------------------------------------------------------------------------
# PTX normalisation.

_DROP = re.compile(r"^\s*(\.loc\b|\.file\b|//|\$L__tmp\d+:\s*$)")
_DEBUG_SECTION = re.compile(r"^\s*\.section\s+\.debug_")
_TRAILING_COMMENT = re.compile(r"\s*//.*$")  # e.g. "$L__BB0_3:  // =>This Loop Header"


def normalize_ptx(ptx: str) -> str:
  """`ptx` without debug info, comments and blank lines (see the module docstring)."""
  lines = ptx.splitlines()
  out = []
  i = 0
  while i < len(lines):
    line = lines[i]
    if _DEBUG_SECTION.match(line):
      depth, opened = 0, False
      while i < len(lines):
        depth += lines[i].count("{") - lines[i].count("}")
        opened = opened or "{" in lines[i]
        i += 1
        if opened and depth <= 0:
          break
      continue
    i += 1
    if _DROP.match(line):
      continue
    line = _TRAILING_COMMENT.sub("", line).rstrip()
    if line:
      out.append(line)
  return "\n".join(out) + "\n"


# ---------------------------------------------------------------------------------------


def lower_variant(v: Variant):
  """Lowers forward + backward of `v` for CUDA; returns the launches recorded."""
  dtype = jnp.dtype(v.dtype)
  q = jax.ShapeDtypeStruct((v.b, v.n, v.h, v.d), dtype)
  kv = jax.ShapeDtypeStruct((v.b, v.n, v.hkv, v.d), dtype)
  dlse = jax.ShapeDtypeStruct((v.b, v.n, v.h), jnp.float32)

  def attention(q, k, v_):
    return dilated_attention(q, k, v_, v.pattern, implementation="triton", return_lse=True)

  def step(q, k, v_, dout, dlse):
    (out, lse), vjp = jax.vjp(attention, q, k, v_)
    return out, lse, vjp((dout, dlse))

  start = len(_records)
  with _pretend_gpu():
    jax.jit(step).trace(q, kv, kv, q, dlse).lower(lowering_platforms=("cuda",))
  return _records[start:]


def fingerprint(launches):
  entries, texts = [], []
  seen = collections.Counter()
  for r in launches:
    text = normalize_ptx(r["ptx"])
    ordinal = seen[r["name"]]
    seen[r["name"]] += 1
    entries.append(dict(
        kernel=r["name"], ordinal=ordinal,
        sha256=hashlib.sha256(text.encode()).hexdigest(), lines=text.count("\n"),
        launch=dict(grid=list(r["grid"]) if r["grid"] else None, num_warps=r["num_warps"],
                    num_stages=r["num_stages"], num_ctas=r["num_ctas"],
                    shared_mem_bytes=r["shared"],
                    compute_capability=r["compute_capability"])))
    texts.append(text)
  return entries, texts


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--out-json", required=True, help="where to write the fingerprints")
  parser.add_argument("--ptx-dir", help="also write the normalised PTX files here")
  parser.add_argument("--variants", action="append",
                      help=f"comma-separated subset of {','.join(VARIANTS)} (repeatable)")
  parser.add_argument("--compare", metavar="BASE_JSON",
                      help="compare with an earlier --out-json; exit 1 on any difference")
  args = parser.parse_args(argv)

  names = list(VARIANTS)
  if args.variants:
    names = [s for arg in args.variants for s in arg.split(",") if s]
    unknown = [s for s in names if s not in VARIANTS]
    if unknown:
      parser.error(f"unknown variants {unknown}; known: {list(VARIANTS)}")

  import triton
  print(f"hilbert_ring_jax: {hilbert_ring_jax.__file__}")
  print(f"jax {jax.__version__}, jax-triton {jax_triton.__version__}, "
        f"triton {triton.__version__}, platforms {os.environ.get('JAX_PLATFORMS')}, "
        f"sm_{COMPUTE_CAPABILITY}")
  if triton.__version__ != "3.6.0":
    print(f"WARNING: triton {triton.__version__}; the GPU machines run 3.6.0", file=sys.stderr)

  _install_hooks()
  result = {}
  t_all = time.perf_counter()
  for name in names:
    t = time.perf_counter()
    launches = lower_variant(VARIANTS[name])
    if not launches:
      raise RuntimeError(f"{name}: no Triton kernel was lowered")
    entries, texts = fingerprint(launches)
    result[name] = entries
    if args.ptx_dir:
      d = os.path.join(args.ptx_dir, name)
      os.makedirs(d, exist_ok=True)
      for i, (e, text) in enumerate(zip(entries, texts)):
        with open(os.path.join(d, f"{i:02d}_{e['kernel']}_{e['ordinal']}.ptx"), "w") as f:
          f.write(text)
    kernels = " ".join(f"{e['kernel'].removesuffix('_kernel')}:{e['sha256'][:10]}"
                       for e in entries)
    print(f"{name:<16} {len(entries):>2} kernels {time.perf_counter() - t:6.1f}s  {kernels}",
          flush=True)

  os.makedirs(os.path.dirname(os.path.abspath(args.out_json)), exist_ok=True)
  with open(args.out_json, "w") as f:
    json.dump(result, f, indent=1)
    f.write("\n")
  total = sum(len(e) for e in result.values())
  print(f"{total} kernels in {len(result)} variants, {time.perf_counter() - t_all:.1f}s "
        f"-> {args.out_json}")
  if args.compare:
    sys.exit(compare(args.compare, result))


def compare(base_path, result) -> int:
  """Prints per variant how `result` compares with the JSON at `base_path`; 1 if it differs."""
  with open(base_path) as f:
    base = json.load(f)
  bad = 0
  for name, entries in result.items():
    if name not in base:
      print(f"compare {name:<16} not in {base_path}")
      continue
    ref = base[name]
    key = lambda es: [(e["kernel"], e["ordinal"], e["sha256"]) for e in es]
    same_ptx = key(entries) == key(ref)
    same_launch = [e["launch"] for e in entries] == [e["launch"] for e in ref]
    bad |= not (same_ptx and same_launch)
    print(f"compare {name:<16} PTX {'same' if same_ptx else 'DIFFERENT'}, "
          f"launches {'same' if same_launch else 'DIFFERENT'}")
    if not same_ptx or not same_launch:
      for i in range(max(len(entries), len(ref))):
        a = entries[i] if i < len(entries) else None
        b = ref[i] if i < len(ref) else None
        if a != b:
          print(f"  #{i}: base {b}\n       now  {a}")
  print("compare: " + ("DIFFERENT" if bad else "all same"))
  return int(bad)


if __name__ == "__main__":
  main()
