"""The training engine: the run resolved for its device, the network assembled, the loop, checkpoints, and the
evaluation. Loop and evaluation share the resolved run and the meters, never each other's internals.

    resolved        every `auto` of params.yaml made concrete for the device and the data (Resolved, resolve)
    autotune        `auto` on a CPU by measuring the candidates, once per machine kind, cached
    timing          the steps autotune times, fed by the training's loader
    assembly        the network a run trains: by name, pretrained weights, fine-tuning, BatchNorm, exact mode
    loop            train(run): epochs of optimizer steps, exact validation, checkpoints and resume
    checkpoint      written atomically by rank 0, loaded safely, resumed exactly
    store_pause     a checkpoint store that is away: a pause of the checkpoints, not the training's end
    optimizer       the optimizer and its learning rate (sqrt world-size scaling, warm-up, cosine)
    objective       the loss: label smoothing, class weights, soft targets
    ema             an exponential moving average of the weights
    selection       which weights leave a training (best or last epoch, raw or EMA), early stopping
    meters          running sums over ranks, a split's loss and accuracy counted exactly
    progress        an epoch's progress bar on rank 0
    stage_outputs   the train stage's DVC outputs (model, metrics, history, run info)
    evaluation      the evaluate stage: test metrics, plots, the champion decision
"""
