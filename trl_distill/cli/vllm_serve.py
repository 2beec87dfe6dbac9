"""`trl-distill vllm-serve --model STUDENT [--port 8000] [-- vLLM's own flags]`: the rollout server of `use_vllm`
(see `trl_distill.rollout.engine_server`), the way `trl vllm-serve` serves GRPO's policy."""

from __future__ import annotations

from dataclasses import dataclass, field

from .errors import errors_as_messages


@dataclass
class VllmServeArguments:
    model: str = field(metadata={"help": "The student: a path or hub id, as training loads it (its weights are "
                                         "replaced by the trainer's at the first rollout)."})
    host: str = field(default="0.0.0.0", metadata={"help": "Address to listen on."})
    port: int = field(default=8000, metadata={"help": "Port to listen on (the trainer's --vllm_server_port)."})
    served_model_name: str | None = field(default=None, metadata={"help": "Name the model is served under."})
    dtype: str = field(default="auto", metadata={
        "help": "vLLM's --dtype (auto: vLLM's rule, the checkpoint's dtype but float32 served in bf16 or fp16; "
                "float32 keeps an fp32 student's weights as they are)."})
    max_model_len: int | None = field(default=None, metadata={"help": "Longest prompt + completion served."})
    gpu_memory_utilization: float | None = field(default=None, metadata={"help": "vLLM's GPU memory share."})
    tensor_parallel_size: int = field(default=1, metadata={"help": "vLLM's tensor parallelism."})
    python: str | None = field(default=None, metadata={
        "help": "The Python with vLLM and trl_distill's vLLM plugin (default: $TRL_DISTILL_VLLM_PYTHON, else the "
        "repository's .venv-vllm that `make vllm-env` builds)."})


def main(argv: list[str]) -> None:
    from transformers import HfArgumentParser

    from ..rollout.engine_server import serve

    ours, extra = (argv[: argv.index("--")], argv[argv.index("--") + 1:]) if "--" in argv else (argv, [])
    parser = HfArgumentParser(VllmServeArguments, prog="trl-distill vllm-serve",
                              description="Serve the student for on-policy rollouts (use_vllm), weights synced by "
                                          "the trainer. Flags after -- go to vLLM as they are.")
    with errors_as_messages("trl-distill vllm-serve"):
        (args,) = parser.parse_args_into_dataclasses(args=ours)
        serve(args.model, host=args.host, port=args.port, served_model_name=args.served_model_name,
              dtype=args.dtype, max_model_len=args.max_model_len,
              gpu_memory_utilization=args.gpu_memory_utilization, tensor_parallel_size=args.tensor_parallel_size,
              python=args.python, extra=extra)
