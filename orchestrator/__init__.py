"""Code that runs on the head: studies, dispatch, the results database, learning, rollout, CLI."""
