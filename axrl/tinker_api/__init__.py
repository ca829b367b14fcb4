"""The Tinker-compatible training and sampling service behind `axrl serve --training`
(docs/service.md): the official `tinker` SDK and tinker-cookbook loops drive the run's train
backend and engine, and every optim_step they take is a recorded, replayable trace step."""
