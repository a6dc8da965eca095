"""The trainer: the policy model (FSDP2 across ranks), the policy loss, one optimizer step
per batch, and checkpoints. Entry points: `model.load_policy`, `step.train_step`,
`checkpoint.save` / `checkpoint.load`, and `model.named_tensors` for publishing."""
