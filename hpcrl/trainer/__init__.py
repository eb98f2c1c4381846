"""The trainer job: take R committed groups, update the policy (and critic) with DeepSpeed, publish weight
versions, checkpoint; its math (advantage estimators, policy losses, KL, off-policy corrections) beside it."""
