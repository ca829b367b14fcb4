"""What a run writes about itself besides the trace files' format (`axrl.trace`): a trained step
turned into its `StepRecord` and metrics line (`records`), `metrics.jsonl` and TensorBoard
(`metrics_log`), the event log of faults and recoveries (`events`) and the deep step dump
(`dump`)."""
