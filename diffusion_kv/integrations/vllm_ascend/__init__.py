"""vllm-ascend as a paged backend of the ``npu`` platform.

:class:`~.backend.VllmAscendBackend` (``npu:vllm-ascend``, priority 200) registers through the
entry-point group ``diffusion_kv.backends``, exactly as another distribution's backend would:
vllm-ascend's ``AscendBlockTables``, its ``build_attn_metadata`` and its
``AscendAttentionBackendImpl``. It serves embedding vLLM hosts (vLLM-Omni on Ascend), which hand
their runtime to the runner as a :class:`~diffusion_kv.core.host.HostRuntime`
(``PagedWorker(..., host=...)``); the backend declares ``needs_host``.

Importing this package never imports vLLM, vllm-ascend or torch_npu.
"""

from diffusion_kv.integrations.vllm_ascend.backend import AscendBlockTablesAdapter, VllmAscendBackend

__all__ = ["AscendBlockTablesAdapter", "VllmAscendBackend"]
