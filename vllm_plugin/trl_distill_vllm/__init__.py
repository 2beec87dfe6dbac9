"""trl_distill's vLLM plugin: registers the ``trl_distill_gloo`` weight-transfer engine (see `gloo_engine`).

vLLM calls `register` in every one of its processes (entry point ``vllm.general_plugins``); the engine module is
imported lazily, only by the worker that builds it (``--weight-transfer-config '{"backend": "trl_distill_gloo"}'``).
"""

BACKEND = "trl_distill_gloo"


def register() -> None:
    """Add the engine to vLLM's weight-transfer registry (idempotent: vLLM may load plugins more than once)."""
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

    if BACKEND not in WeightTransferEngineFactory._registry:  # no public "is registered" query in vLLM 0.32
        WeightTransferEngineFactory.register_engine(BACKEND, "trl_distill_vllm.gloo_engine", "GlooWeightTransferEngine")
