"""vLLM's module path ``vllm.distributed.weight_transfer.nccl_engine``, for
what a trainer imports from it: code written for vLLM changes only the
package prefix. The classes live in ``backends.vllm_native`` (this module
re-exports them): the ``nccl`` backend drives vLLM's own NCCL transport (CUDA,
vLLM importable in the trainer). Its worker-side classes are vLLM's, in the
server, and are not here.
"""

from wt_callbacks.transfer.backends.vllm_native import NCCLTrainerInitInfo, NCCLTrainerWeightTransferEngine

__all__ = ["NCCLTrainerInitInfo", "NCCLTrainerWeightTransferEngine"]
