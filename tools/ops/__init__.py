"""Operations on a running server that take many steps: canary rollouts with automatic rollback
(`rollout`), whose arithmetic lives in `tools.planning.rollout`."""
