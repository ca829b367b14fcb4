"""`runtime.executor: ray`: the same components as Ray actors behind the same protocols.

* `cluster.py` — import Ray (or say which extra installs it), connect to / start a cluster,
  checking the address before any work starts;
* `placement.py` — placement groups for the train ranks and the engine (colocated / separate,
  PACK / SPREAD), refused before work starts when the cluster cannot hold them;
* `actors.py` — the actor classes: an embedded engine, a torch train rank;
* `calls.py` — how a handle reads a failed call; `RestartableActor`, the restart policy (budget,
  events, a resumed new actor) of the rollout and engine handles;
* `engine.py` — `RayEngine`, a `ClockedEngine` that calls the engine actor (and restarts it);
* `train_group.py` — `RayTrainGroup`, a `TrainBackend` over N data-parallel rank actors;
* `handles.py` — what moves by object reference (row shards of a batch, weight snapshots);
* `activity.py` — what each actor is doing (its heartbeat), and `ActorBase`, the pid / node /
  heartbeat methods every actor class shares; `monitor.py` — the heartbeats of every
  actor polled into RUN/status.json (`axrl status RUN`);
* `recovery.py` — a dead train group restarts the run from its last checkpoint;
* `reaper.py` — a local cluster never outlives its driver;
* `executor.py` — builds the Ray-side components for `axrl.runtime.components`.

Nothing here is imported unless the executor is `ray`: `import axrl` never imports Ray.
"""
