"""python -m minitron.plan: the planner's short name (the same as python -m minitron.estimate plan,
minitron/estimate/plan_cli.py): which split of a model over a cluster, and how fast."""
