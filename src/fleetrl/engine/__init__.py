"""Code that runs inside inference worker processes (vLLM, Dynamo). It must not import the
orchestrator or trainer: the provider protocol is the seam between the two sides."""

# The vLLM engine arguments that plug fleetrl's engine side into a worker (native vLLM server
# or Dynamo's vLLM worker, which passes engine arguments through): the extension module's
# import registers the `fleetrl` weight-transfer backend (broadcast over gloo/NCCL, or
# safetensors + manifest) and adds the checksum and group checks.
ENGINE_ARGS = [
    "--worker-extension-cls", "fleetrl.engine.worker_extension.FleetrlWorkerExtension",
    "--weight-transfer-config", '{"backend": "fleetrl"}',
]
