"""What the framework bindings share: the world, process sets, async handles, collectives
on host arrays and the elastic core."""
