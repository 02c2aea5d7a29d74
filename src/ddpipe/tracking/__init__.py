"""Everything a run leaves in MLflow, written on global rank 0 only (every other rank gets a tracker that does
nothing), and every write through the outbox so that a store that is down loses nothing.

    tracker         the MLflow run of a training (Tracker, MlflowTracker, RunLogger, make_tracker)
    outbox          a run's records kept on disk until the store has them (ddpipe outbox)
    delivery        how each kind of outbox record reaches MLflow
    store           where runs go (the tracking-URI rule), the experiment, sweep parents, git tags
    champion        registered versions and the alias that moves only to a better one
    system_metrics  MLflow's system metrics of each node
    access          whether this user may write runs to the tracking server
    sweeps          a sweep's children as mean ± std over seeds (ddpipe sweeps)
"""
