"""Code that runs inside inference worker processes (vLLM, Dynamo). It must not import the
orchestrator, trainer or coordinator: what it shares with the launchers is in
fleetrl.contract; of fleetrl.weights it uses the receiving side and the wire records only."""
