"""fleetrl: asynchronous RL against a fleet of inference workers."""
