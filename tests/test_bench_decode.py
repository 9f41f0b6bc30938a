"""benchmarks/bench_decode.py runs end to end at a tiny size (the GPU figures use the same code)."""

import pathlib
import sys

import jax.numpy as jnp
import pytest

sys.path.insert(0, str(pathlib.Path(__file__).parents[1] / "benchmarks"))
import bench_decode  # noqa: E402  pylint: disable=wrong-import-position
from hilbert_ring_jax import DilatedPattern  # noqa: E402


def test_formula_rows():
  # The count: 11,606 rows per head for H = Hkv = 16 over its LongNet pattern.
  p = bench_decode.parse_pattern("2048,4096,8192,16384,32768/1,2,4,6,12")
  assert bench_decode.formula_rows(p, 16, 16) == 16 * 11606
  # GQA 16/4: a kv head holds the residues of its 4 query heads (r=6: {4,5,0,1} for heads 4-7).
  assert bench_decode.formula_rows(p, 16, 4) == 4 * (2048 + 2 * 2048 + 4 * 2048 + 8 * 2731)
  every = DilatedPattern((8, 12), (2, 5), causal=True, offsets="all")
  assert bench_decode.formula_rows(every, 2, 1) == 2 * 4 + 5 * 3


@pytest.mark.slow  # ~25 s: the benchmark's own run, at its smallest
def test_quick_run(tmp_path):
  out = tmp_path / "decode.json"
  result = bench_decode.main(["--quick", "--batch", "1", "--kv-heads", "2", "--prompts", "40",
                              "--pattern", "16/2", "--prefill", "32", "--runs", "1",
                              "--inner", "2", "--loops", "1", "--json", str(out)])
  assert out.exists()
  *checks, step, prefill = result["rows"]
  assert [c["step"] for c in checks] == ["default", "xla"]
  assert all(c["max_rel_err"] < 1e-5 for c in checks)  # the timed steps compute the right numbers
  assert step["ours"] == "xla"  # on CPU the default token step is the jnp one
  assert step["cache_vs_formula"] == pytest.approx(1.0, abs=1e-3)
  # Threaded through every timed call (3 warm-up, 1 call, 2 loops of 2), ending at the prompt.
  assert step["first_position"] == 40 - (3 + 1 + 2 * 2) and step["length_after"] == 40
  assert step["peer_status"] == "ok" and step["peer_step_ms"] > 0
  assert prefill["prefill_ms"] > 0 and prefill["forward_ms"] > 0
  assert jnp.dtype(result["meta"]["dtype"]) == jnp.float32


@pytest.mark.parametrize("argv,match", [
    (["--steps", "foo"], "--steps: unknown step(s) 'foo'; valid: default,"),
    (["--pattern", "abc"], "--pattern must be 'w1,w2,.../r1,r2,...'"),
    (["--pattern", "16,32/1"], "--pattern '16,32/1': "),
])
def test_bad_flags(capsys, argv, match):
  """Flags argparse refuses, naming them, before any JAX work."""
  with pytest.raises(SystemExit) as exit_:
    bench_decode.main(["--quick", *argv])
  assert exit_.value.code == 2 and match in capsys.readouterr().err
