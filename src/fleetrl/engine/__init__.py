"""Code that runs inside inference worker processes (vLLM, Dynamo). It must not import the
orchestrator, trainer or coordinator: what it shares with the launchers is in
fleetrl.contract, and the weight-transfer schema in fleetrl.weights.wire."""
