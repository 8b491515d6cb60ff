"""Build for several targets at once (`make fleet`): one Ray task per target of params.yaml
`fleet.targets` (pipeline/core/fleet_params.py), each in its own clone at the driver's revision on
a node of that target, sharing conversions through DVC's run-cache (docs/fleet.md)."""
