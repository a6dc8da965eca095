"""Code that runs inside inference worker processes (vLLM, Dynamo). It must not import the
orchestrator or trainer: the provider protocol is the seam between the two sides."""
