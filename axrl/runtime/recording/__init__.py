"""What a run writes about itself besides the trace files' format (`axrl.trace`): a trained step
turned into its `StepRecord` and metrics line (`records`), `metrics.jsonl` and TensorBoard
(`metrics_log`), W&B and MLflow runs (`trackers`, with the reward plot of `reward_plot`), the
event log of faults and recoveries (`events`) and the deep step dump (`dump`)."""
