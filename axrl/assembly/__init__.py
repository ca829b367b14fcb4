"""The assembly layer: the only reader of `axrl.config`.

`settings` turns each config section into the settings object of the component it configures;
`build` wires the components from them — in this process (`axrl.runtime.components`) or as Ray
actors (`axrl.ray_executor`), the choice sitting above both — and runs the loop; `resume` says
what `--resume` continues with. Replay and the debugger rebuild a run's pieces through here.
"""
