"""The names under which a model's test figures are logged and read back, in one place: the evaluate stage logs
them into the run, the champion gate tags each registered version with them and compares versions by them, a sweep's
summary averages them over its runs, and a cluster's status table shows them."""

TEST_ACCURACY, TEST_LOSS, TEST_MACRO_F1 = "test_accuracy", "test_loss", "test_macro_f1"
# the digest of the test split a version was measured on (tracking.champion): only versions of one split compare
TEST_SPLIT = "test_split"
# the exported model's validation accuracy (ddpipe.engine.meters.EpochStats.of_weights): the figure the champion alias
# moves by, its validation split's digest beside it (only versions of one validation split compare)
MODEL_VAL_ACCURACY, VAL_SPLIT = "model_val_accuracy", "val_split"
