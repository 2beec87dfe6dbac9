"""`trl-distill build-ops` (`trl_distill.cli.build_ops`, run by `make setup`): DeepSpeed's CPU comm op is made ready
where a process group would load it, before any launch, over the lock a killed first build leaves."""

import os
import subprocess
import sys

from build_lock import OP, plant_stale_build_lock, private_build_root  # tests/ is on sys.path


def test_build_ops_readies_the_comm_op_where_a_process_group_loads_it(tmp_path):
    extensions = private_build_root(tmp_path / "torch_extensions")  # a TORCH_EXTENSIONS_DIR of the user's
    lock = plant_stale_build_lock(extensions)
    done = subprocess.run([sys.executable, "-m", "trl_distill", "build-ops"], capture_output=True, text=True,
                          timeout=300, env={**os.environ, "TORCH_EXTENSIONS_DIR": str(extensions)})
    assert done.returncode == 0, done.stderr[-3000:]
    op = extensions / OP / f"{OP}.so"
    assert done.stdout.startswith(f"DeepSpeed's {OP} op is ready (") and done.stdout.endswith(f" s): {op}\n")
    assert done.stderr.count(f"trl-distill: removed a stale build lock, {lock}") == 1 and not lock.exists()
    assert op.is_file()
