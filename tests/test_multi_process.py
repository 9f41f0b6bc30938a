"""The ring under `jax.distributed.initialize()`: two processes of 4 CPU devices each equal one
process of 8 (`examples/multi_gpu.py`, the fingerprints it prints), causal, the sequence in
zigzag order in one of the two runs."""

import os
import pathlib
import re
import socket
import subprocess
import sys

import pytest

SCRIPT = pathlib.Path(__file__).resolve().parents[1] / "examples" / "multi_gpu.py"
ARGS = ["--seq-len", "1024", "--heads", "2", "--kv-heads", "1", "--head-dim", "16", "--causal"]


def _run(extra, processes=1):
  """The fingerprint rows `{name: (norm, checksum, error)}` process 0 prints."""
  env = {**os.environ, "JAX_PLATFORMS": "cpu"}
  env.pop("XLA_FLAGS", None)  # the script sets its own devices
  if processes == 1:
    runs = [[sys.executable, str(SCRIPT), *ARGS, *extra]]
  else:
    with socket.socket() as s:
      s.bind(("localhost", 0))
      port = s.getsockname()[1]
    runs = [[sys.executable, str(SCRIPT), *ARGS, *extra, "--distributed", "--coordinator",
             f"localhost:{port}", "--num-processes", str(processes), "--process-id", str(i),
             "--cpu-devices", str(8 // processes)] for i in range(processes)]
  procs = [subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True) for cmd in runs]
  try:
    outputs = [p.communicate(timeout=240)[0] for p in procs]
  finally:
    for p in procs:
      p.kill()
  for p, out in zip(procs, outputs):
    assert p.returncode == 0, out[-3000:]
  rows = re.findall(r"^(out|dq|dk|dv)\s+(\S+)\s+(\S+)\s+(\S+)$", outputs[0], re.M)
  assert len(rows) == 4, outputs[0][-3000:]
  return {name: tuple(float(x) for x in values) for name, *values in rows}


@pytest.mark.slow  # ~60 s on 2 cores: three processes compile the ring
def test_two_processes_equal_one():
  one = _run(["--layout", "natural"])
  two = _run(["--layout", "zigzag"], processes=2)
  for name in ("out", "dq", "dk", "dv"):
    (norm1, sum1, err1), (norm2, sum2, err2) = one[name], two[name]
    assert err1 < 1e-5 and err2 < 1e-5, (name, err1, err2)  # each against one device
    assert abs(norm1 - norm2) <= 1e-5 * norm1 and abs(sum1 - sum2) <= 1e-5 * norm1, name
