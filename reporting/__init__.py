"""What a run reports: everything it writes into its run directory except checkpoints.

    runlog.py       the run directory and its lock, config.yaml, metrics.jsonl,
                    TensorBoard, summary.txt, the progress bar
    metrics.py      the name of every tag and metrics.jsonl key, the epoch record and line
    tracking.py     --mlflow
    plots.py        the confusion-matrix image
    profiling.py    --profile-steps
    lr_finder.py    --find-lr, the LR range test
    gan_metrics.py  FID and KID (torchmetrics) on Inception's or a classifier's features;
                    a generator's images (generate, to_uint8)

Imports the machinery and the input pipeline below it, never a task.
"""
