"""Datasets, from their sources to the batches a rank trains on; one module per part, imports running down:

    loaders      what a rank reads: samplers (keyed order), the DataLoader and its workers, TrainingData, Views
    transforms   keyed augmentation and the evaluation crop (the served model applies the same)
    prepare      the prepare stage: source -> seeded stratified splits -> the store, in parallel, atomically
    fetching     the fetch stage: where a dataset's files come from (source_dir, Debian, download)
    formats      the parsers of the fetched files (the MNISTs' IDX, CIFAR-10's pickles)
    folders      a folder of one's own: its class folders listed, and what it leaves out
    verify       the official files' names and MD5 checks; DataSourceError
    images       one source image: probed, decoded, oriented, converted, re-encoded (PIL and numpy only)
    splits       stratified seeded splits and the class subset
    encoding     data.encoding made concrete (raw or encoded), the small-image threshold
    augment      keyed per-image augmentation and MixUp/CutMix
    sampling     an epoch's global order (uniform, balanced) and the loss's class weights
    store        the prepared format on disk (meta.json, labels, raw pixel arrays or encoded shards + index)
                 and its memory-mapped reader

Nothing is imported here: the prepare stage's worker processes import only ``images`` (no torch).
"""
