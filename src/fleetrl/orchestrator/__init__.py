"""Rollout scheduling, off-policy control, rewards and advantages, batch assembly."""
