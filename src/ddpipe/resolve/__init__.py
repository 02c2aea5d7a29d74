"""The resolver: every ``auto`` of params.yaml made concrete, here and nowhere else (no other module compares a
value with ``auto``). ``run``: a training's whole run for its device and data (the launcher, the workers, the
evaluate stage); ``encoding``: the prepare stage's storage format for the images it found. Apart, so that the
prepare stage depends on what decides its own output only."""
